"""The benchmarks of the step's parts (README, docs/benchmarks.md) run at their smallest size: a crash fails here,
and each reports what its table prints."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_fetch_gather_compares_both_gathers_on_equal_bytes():
    """The script exits non-zero when the two gathers' bytes differ; one line per thread count."""
    out = _run("fetch_gather.py", "--cols", "16", "--tokens", "256", "--rounds", "1")
    lines = [line for line in out.splitlines() if "after/before" in line]
    assert lines and all("before" in line and " ms" in line for line in lines), out


@pytest.mark.slow
def test_stem_layer_times_dense_and_both_stem_paths():
    records = json.loads(_run("stem_layer.py", "--models", "350M", "--tokens", "64", "--rounds", "2", "--warmup", "0",
                              "--json"))
    (record,) = records
    assert set(record["ms"]) == {"dense", "stem, gather", "stem"} and all(t > 0 for t in record["ms"].values())
    assert record["over_dense"]["dense"] == 1.0 and record["rows"] <= 64
    lo, hi = record["rows_range"]  # a micro-batch of its own each round: the row count changes, as in training
    assert lo < hi and lo <= record["rows"] <= hi and abs(record["expected_rows"] - record["rows"]) <= 8


@pytest.mark.slow
def test_update_order_reports_both_optimizers_in_both_orders_and_the_working_set():
    out = _run("update_order.py", "--tokens", "512", "--cols", "16", "--layers", "1", "--device-step", "0",
               "--steps", "3", "--repeats", "1", "--resident", "64")
    rows = [line.split() for line in out.splitlines() if line.startswith(("lazy", "dense"))]
    assert [r[0] for r in rows] == ["lazy"] * 3 + ["dense"] * 3, out
    resident = [r for r in rows if "working" in r]
    assert len(resident) == 2 and all(len(r) == len(rows[0]) + 7 for r in resident), out
    assert all(int(r[-3].replace(",", "")) > 0 for r in resident), out  # rows entered the 64-row set each step
    assert all(int(r[-2].replace(",", "")) > 0 for r in resident), out  # rows staged ahead, by both optimizers
