"""The benchmarks of the step's parts (README, docs/benchmarks.md) run at their smallest size: a crash fails here,
and each reports what its table prints."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
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


@pytest.mark.slow
def test_exchange_overlap_runs_both_settings_on_two_nodes(tmp_path):
    """``benchmarks/exchange_overlap.py`` at its smallest: one run a setting of 2 steps (the first left out), on
    the 128k profile's first 512 ids (a small vocabulary, the same draws). Both settings are in its JSON and its
    table; overlapped, both STEM layers leave during backward, after it none; the same rows are sent and the losses
    are the same bit for bit."""
    counts = tmp_path / "counts.npy"
    np.save(counts, np.load(REPO / "benchmarks" / "data" / "token_counts_128k.npy")[:512])
    report = tmp_path / "overlap.json"
    out = _run("exchange_overlap.py", "--rounds", "1", "--steps", "2", "--skip", "1", "--counts", str(counts),
               "--out", str(tmp_path / "runs"), "--json", str(report))
    result = json.loads(report.read_text())
    assert set(result) == {"off", "on", "what", "vocab", "rounds", "steps", "losses_identical", "step_time_ratio"}
    keys = {"step_time_s", "stem_exchange_wait_s", "stem_exchange_s", "stem_layers_sent_in_backward",
            "stem_node_bytes_sent"}
    assert set(result["off"]) == set(result["on"]) == keys
    assert (result["what"], result["vocab"], result["rounds"], result["steps"]) == ("exchange", 512, 1, 2)
    assert result["off"]["stem_layers_sent_in_backward"] == 0 and result["on"]["stem_layers_sent_in_backward"] == 2
    assert result["off"]["stem_node_bytes_sent"] == result["on"]["stem_node_bytes_sent"] > 0
    assert result["losses_identical"] is True
    assert result["step_time_ratio"] == result["on"]["step_time_s"] / result["off"]["step_time_s"]
    rows = [line.split()[0] for line in out.splitlines() if line.split()[:1] in (["off"], ["on"])]
    assert rows == ["off", "on"] and "losses identical: yes" in out, out
