"""benchmarks/sparse_layers.py runs all three variants in one pair of gloo processes and its byte accounting
holds: for dense and STEM the bytes the collectives observed are the computed ones (gradient sync + the row
exchange), so the benchmark's comparison with Hash-MoE's all-to-all counts every collective."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_two_rounds_count_every_collective():
    proc = subprocess.run([sys.executable, "benchmarks/sparse_layers.py", "--rounds", "2", "--warmup", "1", "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    variants = json.loads(proc.stdout)["variants"]
    assert set(variants) == {"dense", "stem-1/3", "hash-moe-1/3"}
    for name in ("dense", "stem-1/3"):
        v = variants[name]
        assert v["computed_bytes"] > 0
        assert abs(v["observed_bytes"] - v["computed_bytes"]) < 1024, v  # the loss and norm all-reduces: bytes
    assert variants["stem-1/3"]["sparse_bytes"] > 0 and variants["hash-moe-1/3"]["sparse_bytes"] > 0
