"""Host memory is checked before any table exists: a node whose shared-memory directory cannot hold its STEM
tables stops at start with the bytes needed, the bytes there and the fixes (exit code 1), where mapping
the tables used to die later with a bare bus error (signal 7, exit 135)."""

import subprocess
import sys

import pytest
from conftest import VOCAB


@pytest.mark.slow
def test_a_small_shared_memory_directory_is_a_clear_error_at_start(corpus, tmp_path):
    """A 64 MB /dev/shm (a container's default) in a mount namespace of its own, and tables of 0.56 GiB."""
    train = [sys.executable, "-m", "stem_megatron.train", "parallel=single", "model.vocab_size=65536",
             f"data.vocab_size={VOCAB}", f"data.dir={corpus}", f"out_dir={tmp_path / 'run'}", "train.steps=2",
             "train.eval_iters=0"]
    script = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"'
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *train],
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in out, out[-3000:]
    assert "the STEM host tables of this node need 0.56 GiB in /dev/shm" in out
    assert "0.06 GiB free" in out and "--shm-size" in out and "stem.shm_dir" in out
