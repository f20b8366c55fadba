"""``make gpu-check`` where no GPU is: the goals table it builds from a step benchmark's records (the ratios, what a
missing run leaves, a baseline beside), and its one-line refusal on a machine without a GPU."""

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from gpu_check import goal_rows, summary  # noqa: E402


def _record(model, variant, step, peak=None, status="ok", note=""):
    return {"model": model, "variant": variant, "status": status, "note": note, "step_time_s": step,
            "peak_memory_bytes": peak}


RECORDS = [_record("350M", "dense", 1.0), _record("350M", "stem_1_3_host_lazy", 1.1),
           _record("350M", "stem_full_host", 0.8), _record("350M", "stem_1_3_device", None, status="out of memory",
                                                           note="not run: the plan's 90 GiB"),
           _record("1B", "dense", 2.0, peak=40e9), _record("1B", "stem_1_3_host_lazy", 1.9, peak=42e9)]


def test_the_goals_are_ratios_of_the_same_invocation_and_a_missing_run_says_why():
    rows = {r["figure"]: r for r in goal_rows(RECORDS)}
    lazy = rows["350M STEM-1/3 host, lazy Adam / dense"]
    assert abs(lazy["value"] - 1.1) < 1e-12 and lazy["met"] is False and lazy["at_most"] == 1.0
    assert rows["350M STEM-full host / dense"]["met"] is True
    assert abs(rows["1B STEM-1/3 host, lazy Adam / dense"]["value"] - 0.95) < 1e-12
    device = rows["350M STEM-1/3 host / device tables"]
    assert device["value"] is None and device["met"] is None
    assert device["why"] == "stem_1_3_device: out of memory (not run: the plan's 90 GiB)"
    assert rows["1B STEM-full host / dense"]["why"] == "stem_full_host: not run"
    peak = rows["1B STEM-1/3 host peak / dense peak"]
    assert abs(peak["value"] - 1.05) < 1e-12 and peak["met"] is True


def test_the_summary_puts_a_baseline_beside_and_ends_with_the_audits():
    before = [dict(r, step_time_s=(r["step_time_s"] or 0) * 1.2) if r["variant"] != "dense" else r for r in RECORDS]
    text = summary(goal_rows(RECORDS, before), {"sync": "step 3: 12 synchronising CUDA calls"}, baseline=True)
    lines = text.splitlines()
    assert lines[0] == "| figure | before | measured | at most | goal | met |"
    assert "| 350M STEM-1/3 host, lazy Adam / dense | 1.32x | 1.10x | 1.00x | 0.95x | NO |" in lines
    assert lines[-1] == "- step 3: 12 synchronising CUDA calls"


def test_gpu_check_refuses_a_machine_without_a_gpu(tmp_path):
    """No nvidia-smi on the PATH (as on this CI machine; hidden here on a GPU node too): one line, exit 2."""
    root = Path(__file__).resolve().parents[1]
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(root / "tools" / "gpu_check.py")], capture_output=True, text=True,
                          cwd=root, env=env, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "gpu-check: no GPU here (nvidia-smi lists none): run it on a GPU node (docs/gpu.md)")
