"""Benchmarks and tools run by a Python without the project's environment, or on a missing corpus, stop with one
line naming `make setup` (stem_megatron/setup_check.py), not a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = {"study_arms.py"}  # imported by study.py and study_report.py, never run; stdlib only
SCRIPTS = sorted(p for p in [*ROOT.glob("benchmarks/*.py"), *ROOT.glob("tools/*.py")] if p.name not in LIBRARIES)


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A fresh venv: the interpreter the project's venv was made from, none of its packages."""
    venv = tmp_path_factory.mktemp("bare")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv / "bin" / "python"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_python_without_the_project_gets_the_fix(bare_python, script):
    """The arguments come back quoted in the command to rerun (wandb_dashboard.py checks after parsing them)."""
    relative = script.relative_to(ROOT)
    proc = subprocess.run([str(bare_python), str(relative), "--title", "a b"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert proc.stderr.startswith(f"{script.name}: this Python ({bare_python}) does not have "), proc.stderr
    assert proc.stderr.endswith(f": run `make setup`, then `.venv/bin/python {relative} --title 'a b'`\n"), proc.stderr
    assert len(proc.stderr.splitlines()) == 1


def test_from_elsewhere_the_fix_names_the_checkout(bare_python, tmp_path):
    proc = subprocess.run([str(bare_python), str(ROOT / "benchmarks" / "stem_host.py")], capture_output=True,
                          text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.endswith(f"run `make -C {ROOT} setup`, then `{ROOT}/.venv/bin/python "
                                f"{ROOT}/benchmarks/stem_host.py`\n"), proc.stderr


def test_the_projects_python_passes():
    proc = subprocess.run([sys.executable, "-c", "from stem_megatron.setup_check import environment_problem; "
                           "print(environment_problem())"], capture_output=True, text=True, timeout=60)
    assert proc.stdout == "None\n", proc.stderr


def test_a_missing_corpus_names_make_setup(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/study.py", "--data-dir", str(tmp_path / "absent")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2  # argparse's usage error
    assert (f"study.py: error: {tmp_path / 'absent'}/tokenizer.json is missing: `make setup` builds the demo corpus "
            "(data_cache/python-doc), `stem-preprocess` any other (README, Data)") in proc.stderr
