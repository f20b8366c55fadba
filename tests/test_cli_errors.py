"""The export-reading CLIs (stem-eval, stem-generate, stem-edit) end bad input with one line naming it and the
fix, exit code 1, not a traceback."""

import subprocess
import sys

import pytest

CLIS = {  # command -> (module, arguments besides --export)
    "stem-eval": ("stem_megatron.eval.cli", ["--out", "results.json", "--ppl", "--data", "valid"]),
    "stem-generate": ("stem_megatron.inference.cli", ["--prompt", "import", "--max-new-tokens", "2"]),
    "stem-edit": ("stem_megatron.edit.cli", ["--source", " heapq", "--target", " bisect", "--prompt", "import"]),
}


@pytest.mark.parametrize("command", CLIS)
def test_a_missing_export_is_one_line(command, tmp_path):
    module, args = CLIS[command]
    proc = subprocess.run([sys.executable, "-m", module, "--export", str(tmp_path / "absent"), *args],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr == (f"{command}: error: export directory {tmp_path / 'absent'} does not exist (a run writes "
                           "one with checkpoint.export=DIR)\n"), proc.stderr
