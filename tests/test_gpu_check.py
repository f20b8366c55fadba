"""``make gpu-check`` where no GPU is: the goals table it builds from a step benchmark's records (the ratios, what a
missing run leaves, a baseline beside), what it runs inside a lease's deadline and what a second command adds, and its
one-line refusal on a machine without a GPU."""

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from gpu_check import (HEADLINE, OTHERS, PARTS, RUN_S, STEPS_START_S, goal_rows, merge_records, plan_part,  # noqa: E402
                       summary)


def _record(model, variant, step, peak=None, status="ok", note=""):
    return {"model": model, "variant": variant, "status": status, "note": note, "step_time_s": step,
            "peak_memory_bytes": peak}


RECORDS = [_record("350M", "dense", 1.0), _record("350M", "stem_1_3_host_lazy", 1.1),
           _record("350M", "stem_full_host", 0.8), _record("350M", "stem_1_3_device", None, status="out of memory",
                                                           note="not run: the plan's 90 GiB"),
           _record("1B", "dense", 2.0, peak=40e9), _record("1B", "stem_1_3_host_lazy", 1.9, peak=42e9),
           _record("1B", "stem_1_3_resident_dense", 2.4)]
LAYER = [{"model": "350M", "over_dense": {"dense": 1.0, "stem, gather": 0.9, "stem": 0.7}}]
PART = {p.name: p for p in PARTS}


def test_the_goals_are_ratios_of_the_same_machine_and_a_missing_run_says_why():
    rows = {r["figure"]: r for r in goal_rows({"records": RECORDS, "layer": LAYER})}
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
    # the recipe's dense Adam: a figure without a bound
    recipe = rows["1B STEM-1/3 working set, dense Adam / dense"]
    assert abs(recipe["value"] - 1.2) < 1e-12 and recipe["at_most"] is None and recipe["met"] is None
    layer = rows["350M STEM layer / dense FFN, forward + backward"]
    assert layer["value"] == 0.7 and layer["met"] is True and layer["goal"] == 0.67
    assert rows["1B STEM layer / dense FFN, forward + backward"]["why"] == "layer: not run"


def test_the_summary_puts_a_baseline_beside_then_the_parts_then_the_audits():
    before = [dict(r, step_time_s=(r["step_time_s"] or 0) * 1.2) if r["variant"] != "dense" else r for r in RECORDS]
    parts = {"gpu tests": {"status": "ok", "seconds": 97.4, "planned": 120},
             "350M others": {"status": "not run: 40 s left, a run needs about 55 s"}}
    text = summary(goal_rows({"records": RECORDS}, {"records": before}), parts,
                   {"sync": "step 3: 12 synchronising CUDA calls"}, baseline=True)
    lines = text.splitlines()
    assert lines[0] == "| figure | before | measured | at most | goal | met |"
    assert "| 350M STEM-1/3 host, lazy Adam / dense | 1.32x | 1.10x | 1.00x | 0.95x | NO |" in lines
    assert "| 1B STEM-1/3 working set, dense Adam / dense | 1.44x | 1.20x | - | - | - |" in lines
    assert "| gpu tests | ok | 97 | 120 |" in lines
    assert "| 350M others | not run: 40 s left, a run needs about 55 s | - | - |" in lines
    assert lines[-1] == "- step 3: 12 synchronising CUDA calls"


def test_a_deadline_runs_what_fits_in_order_and_a_second_command_runs_only_the_rest():
    state = {"parts": {}, "records": [], "layer": []}
    headline = PART["1B headline"]
    # two of the four 1B runs fit: the first two, dense first
    left = STEPS_START_S + 2 * RUN_S["1B"] + 1
    assert plan_part(headline, state, left) == (("dense", "stem_1_3_resident_lazy"), "")
    assert plan_part(headline, state, left - 2)[0] == ("dense",)  # the part's own start counts
    assert plan_part(headline, state, STEPS_START_S + RUN_S["1B"] - 1) == (
        None, f"not run: {STEPS_START_S + RUN_S['1B'] - 1} s left, a run needs about {RUN_S['1B']} s")
    assert plan_part(PART["gpu tests"], state, 30.0) == (None, "not run: 30 s left, it needs about 200 s")
    assert plan_part(PART["gpu tests"], state, None) == ((), "")
    # what the first command measured (one run stopped by the deadline counts as not run)
    merge_records(state, [_record("1B", "dense", 2.0), _record("1B", "stem_1_3_resident_lazy", None,
                                                               status="not run", note="50 s left before --until")])
    state["parts"]["gpu tests"] = {"status": "exit 1", "seconds": 100.0, "planned": 120}
    assert plan_part(headline, state, None) == (
        ("stem_1_3_resident_lazy", "stem_1_3_resident_fit", "stem_1_3_host_lazy"), "")
    assert plan_part(PART["gpu tests"], state, None) == (None, "ran earlier")  # a failure is not rerun
    merge_records(state, [_record("1B", "stem_1_3_resident_lazy", 1.8), _record("1B", "stem_1_3_resident_fit", 1.85),
                          _record("1B", "stem_1_3_host_lazy", 1.9)])
    assert plan_part(headline, state, None) == (None, "ran earlier")
    assert [(r["variant"], r["step_time_s"]) for r in state["records"]] == [
        ("dense", 2.0), ("stem_1_3_resident_lazy", 1.8), ("stem_1_3_resident_fit", 1.85), ("stem_1_3_host_lazy", 1.9)]


class _Clock:
    """Seconds that pass only when a part runs."""

    def __init__(self):
        self.now = 1_000_000.0

    def time(self):
        return self.now

    def perf_counter(self):
        return self.now


def test_two_commands_in_one_lease_measure_everything_once_and_return_what_a_lease_can(tmp_path, monkeypatch):
    """main() with its parts stood in for (each takes its planned seconds and writes what its command would): the
    first command, with 570 s (docs/gpu.md's), runs the tests, 1B's headline and what else fits, and leaves the rest
    with why; the second (--resume) runs only the rest; OUT holds at most 8 files, and the summary every figure of
    both."""
    import json

    import gpu_check

    import stem_megatron.doctor.cuda

    clock = _Clock()
    monkeypatch.setattr(gpu_check, "time", clock)
    monkeypatch.setattr(stem_megatron.doctor.cuda, "nvidia_smi_gpus", lambda: ["H100"])
    ran = []

    def step(name, cmd, log, timeout):
        part = next(p for p in PARTS if p.name == name)
        ran.append((name, tuple(cmd[cmd.index("--variants") + 1].split(",")) if "--variants" in cmd else ()))
        assert timeout <= until - clock.now + 20  # stopped by the deadline at the latest
        if part.kind == "steps":  # whose runs stop themselves by then
            assert float(cmd[cmd.index("--until") + 1]) <= until
        clock.now += part.seconds if part.kind != "steps" else STEPS_START_S + RUN_S[part.model] * len(ran[-1][1])
        assert clock.now <= until  # it fitted
        if part.kind == "steps":
            records = [_record(part.model, v, 1.0 if v == "dense" else 0.9, peak=1e9) for v in ran[-1][1]]
            Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps({"records": records}))
        if part.kind == "layer":
            Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(LAYER))
        log.write_text("log\n")
        return 0, 1.0

    monkeypatch.setattr(gpu_check, "step", step)
    work, first, second = tmp_path / "work", tmp_path / "out1", tmp_path / "out2"
    until = clock.now + 570
    assert gpu_check.main(["--out", str(first), "--work", str(work), "--until", str(until)]) == 0
    # 10 s kept for the summary, 200 s of tests, 1B's four runs (20 + 4 x 75), none of the rest in 40 s
    assert ran == [("gpu tests", ()), ("1B headline", HEADLINE["1B"])]
    text = (first / "summary.md").read_text()
    assert "| layer | not run: 40 s left, it needs about 45 s | - | - |" in text
    assert "| 350M headline | not run: 40 s left, a run needs about 55 s | - | - |" in text
    assert "| stem-doctor | not run: 40 s left, it needs about 90 s | - | - |" in text
    assert "| 1B STEM-1/3 working set, lazy / dense | 0.90x | 1.00x | 0.95x | yes |" in text
    assert "| 1B STEM-1/3 working set within dense + 10%, peak / dense peak | 1.00x | 1.10x | - | yes |" in text
    assert "350M STEM-1/3 working set, lazy / dense | - (stem_1_3_resident_lazy: not run)" in text
    assert len(list(first.iterdir())) <= 8
    ran.clear()
    until = clock.now + 1000
    assert gpu_check.main(["--out", str(second), "--work", str(work), "--until", str(until), "--resume"]) == 0
    # 990 s: the layer (45), 350M's headline (185), the others at 1B (395) and 350M (350); 15 s: no doctor
    assert ran == [("layer", ()), ("350M headline", HEADLINE["350M"]), ("1B others", OTHERS["1B"]),
                   ("350M others", OTHERS["350M"])]
    saved = json.loads((second / "gpu_step.json").read_text())
    assert sorted((r["model"], r["variant"]) for r in saved["records"]) == sorted(
        (m, v) for m in ("1B", "350M") for v in HEADLINE[m] + OTHERS[m])
    text = (second / "summary.md").read_text()
    assert "| gpu tests | ok | 1 | 200 |" in text and "| stem-doctor | not run: 15 s left, it needs about 90 s" in text
    assert "| 350M STEM layer / dense FFN, forward + backward | 0.70x | 0.75x | 0.67x | yes |" in text
    assert len(list(second.iterdir())) <= 8


def test_the_parts_put_the_goals_headline_first_and_every_variant_in_the_benchmark():
    from benchmarks.gpu_step import VARIANTS

    assert [p.name for p in PARTS][:2] == ["gpu tests", "1B headline"]
    steps = [p for p in PARTS if p.kind == "steps"]
    for model in ("350M", "1B"):
        assert sorted(v for p in steps if p.model == model for v in p.variants) == sorted(VARIANTS)
    assert len({p.log for p in PARTS}) + 4 <= 8  # with gpu_step.json, two audits and summary.md: what a lease returns


def test_gpu_check_refuses_a_machine_without_a_gpu(tmp_path):
    """No nvidia-smi on the PATH (as on this CI machine; hidden here on a GPU node too): one line, exit 2."""
    root = Path(__file__).resolve().parents[1]
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(root / "tools" / "gpu_check.py")], capture_output=True, text=True,
                          cwd=root, env=env, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "gpu-check: no GPU here (nvidia-smi lists none): run it on a GPU node (docs/gpu.md)")
