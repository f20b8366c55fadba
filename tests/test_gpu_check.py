"""``make gpu-check`` where no GPU is: the goals table it builds from a step benchmark's records (the ratios, what a
missing run leaves, a baseline beside), its plan (7 minutes with the setup, the dry run, each estimate's source), its
pre-checks, what it runs inside a lease's deadline and what a second command adds, a failed setup's summary, that every process a part starts ends with it (a stand-in whose
grandchild ignores SIGTERM in a session of its own), that a failing gpu test's report is written as it happens,
the gpu tests' scripts on the CPU, and its one-line refusal on a machine without a GPU."""

import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from gpu_check import merge_records  # noqa: E402
from gpu_goals import GOALS, goal_rows, summary  # noqa: E402
from gpu_plan import (BUDGET_S, DOCTOR_TEST, EXTRA, GPU_ONLY, MODELS, PARTS, STEPS_START_S, SUMMARY_S,  # noqa: E402
                      TRAINING, plan_part, run_seconds)


def _record(model, variant, step, peak=None, status="ok", note=""):
    return {"model": model, "variant": variant, "status": status, "note": note, "step_time_s": step,
            "peak_memory_bytes": peak}


RECORDS = [_record("350M", "dense", 1.0), _record("350M", "stem_1_3_host_lazy", 1.1),
           _record("350M", "stem_full_host", 0.8), _record("350M", "stem_1_3_device", None, status="out of memory",
                                                           note="not run: the plan's 90 GiB"),
           _record("1B", "dense", 2.0, peak=40e9), _record("1B", "stem_1_3_host_lazy", 1.9, peak=42e9),
           _record("1B", "stem_1_3_resident_dense", 2.4)]
LAYER = [{"model": "350M", "over_dense": {"dense": 1.0, "stem, gather": 0.9, "stem": 0.7}}]
PART = {p.name: p for p in PARTS + EXTRA}
HEADLINE = PART["1B-3L headline"].variants


def test_the_goals_are_ratios_of_the_same_machine_and_a_missing_run_says_why():
    rows = {r["figure"]: r for r in goal_rows({"records": RECORDS, "layer": LAYER})}
    lazy = rows["350M STEM-1/3 host, lazy Adam / dense"]
    assert abs(lazy["value"] - 1.1) < 1e-12 and lazy["met"] is False and lazy["at_most"] == 1.0
    assert rows["350M STEM-full host / dense"]["met"] is True
    assert abs(rows["1B STEM-1/3 host, lazy Adam / dense"]["value"] - 0.95) < 1e-12
    device = rows["350M STEM-1/3 host / device tables"]
    assert device["value"] is None and device["met"] is None
    assert device["why"] == "stem_1_3_device: out of memory (not run: the plan's 90 GiB)"
    assert "1B STEM-full host / dense" not in rows  # its tables (189 GB) exceed the lent machine's host
    assert rows["1B-3L STEM-full working set, lazy / dense"]["why"] == "stem_full_resident_lazy: not run"
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
    headline = PART["1B-3L headline"]
    tests = PART["gpu tests"].seconds
    dense = run_seconds("1B-3L", "dense")
    # two of the three 1B-3L runs fit: the first two, dense first
    left = headline.planned(HEADLINE[:2]) + 1
    assert plan_part(headline, state, left) == (HEADLINE[:2], "")
    assert plan_part(headline, state, left - 2)[0] == ("dense",)  # the part's own start counts
    assert plan_part(headline, state, STEPS_START_S + dense - 1) == (
        None, f"not run: {STEPS_START_S + dense - 1} s left, its first run needs about {dense} s")
    assert plan_part(PART["gpu tests"], state, 30.0) == (None, f"not run: 30 s left, it needs about {tests} s")
    assert plan_part(PART["gpu tests"], state, None) == ((), "")
    # what the first command measured (one run stopped by the deadline counts as not run)
    merge_records(state, [_record("1B-3L", "dense", 2.0), _record("1B-3L", "stem_1_3_resident_lazy", None,
                                                                  status="not run", note="50 s left before --until")])
    state["parts"]["gpu tests"] = {"status": "exit 1", "seconds": 100.0, "planned": tests}
    assert plan_part(headline, state, None) == (("stem_1_3_resident_lazy", "stem_1_3_host_lazy"), "")
    assert plan_part(PART["gpu tests"], state, None) == (None, "ran earlier")  # a failure is not rerun
    merge_records(state, [_record("1B-3L", "stem_1_3_resident_lazy", 1.8), _record("1B-3L", "stem_1_3_host_lazy", 1.9)])
    assert plan_part(headline, state, None) == (None, "ran earlier")
    assert [(r["variant"], r["step_time_s"]) for r in state["records"]] == [
        ("dense", 2.0), ("stem_1_3_resident_lazy", 1.8), ("stem_1_3_host_lazy", 1.9)]


class _Clock:
    """Seconds that pass only when a part runs."""

    def __init__(self):
        self.now = 1_000_000.0

    def time(self):
        return self.now

    def perf_counter(self):
        return self.now


class _Exec(Exception):
    """os.execv stood in for: the command line the script goes on with under the venv's Python."""


GOLDEN_LINE = "golden stem_1_3_host: 40 steps, max |dloss| 0.012 <= 0.05, ok"


def _stand_ins(monkeypatch, clock, ran, setup_rc=0):
    """main()'s parts stood in for: each takes its planned seconds and writes what its command would."""
    import gpu_check

    gpu_prechecks = gpu_check.gpu_prechecks  # as gpu_check imports it (tools.gpu_prechecks)
    monkeypatch.setattr(gpu_check, "time", clock)
    monkeypatch.setattr(gpu_check, "take_charge", lambda: None)  # not this pytest process (the stand-in test's)
    monkeypatch.setattr(gpu_prechecks, "gpus", lambda: 1)
    monkeypatch.setattr(gpu_prechecks, "checks", lambda shm, **_: [("ok", "GPU", "1 listed by nvidia-smi"),
                                                                    ("ok", "/dev/shm", f"{shm} B needed")])

    def execv(python, argv):
        raise _Exec(argv)

    monkeypatch.setattr(gpu_check.os, "execv", execv)

    def step(name, cmd, log, timeout):
        part = PART[name]
        variants = tuple(cmd[cmd.index("--variants") + 1].split(",")) if "--variants" in cmd else ()
        ran.append((name, variants))
        if part.kind == "steps":  # whose runs stop themselves by then
            assert float(cmd[cmd.index("--until") + 1]) <= clock.until
        if part.kind == "tests":
            assert cmd[-len(part.tests):] == [f"tests/test_gpu.py::{test}" for test in part.tests]
        clock.now += part.planned(variants or None)
        assert clock.now <= clock.until  # it fitted
        if part.kind == "steps":
            records = [_record(part.model, v, 1.0 if v == "dense" else 0.9, peak=1e9) for v in variants]
            Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps({"records": records}))
        if part.kind == "layer":
            Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(LAYER))
        with open(log, "a") as out:  # as step appends the part's output
            out.write(f"{GOLDEN_LINE}\n" if part.kind == "golden" else "log\n")
        return (setup_rc if part.kind == "setup" else 0), float(part.planned(variants or None))

    monkeypatch.setattr(gpu_check, "step", step)


def test_two_commands_in_one_lease_measure_everything_once_and_return_what_a_lease_can(tmp_path, monkeypatch):
    """main() with its parts stood in for: the first command, as docs/gpu.md's (480 s), runs the pre-checks and the
    setup on the node's Python, goes on under the venv's (os.execv, its command line kept) and runs the default plan
    whole; the second (--resume --all) runs what else fits its 600 s in order and leaves the rest with why; OUT holds
    at most 7 files, and the summary every figure of both, the pre-checks and the golden losses."""
    import gpu_check

    clock, ran = _Clock(), []
    _stand_ins(monkeypatch, clock, ran)
    work, first, second = tmp_path / "work", tmp_path / "out1", tmp_path / "out2"
    clock.until = clock.now + 480
    argv = ["--out", str(first), "--work", str(work), "--until", str(clock.until)]
    with pytest.raises(_Exec) as went_on:
        gpu_check.main(argv)
    assert ran == [("setup", ())] and went_on.value.args[0][2:] == [*argv, "--set-up", "--out", str(first)]
    assert f"| setup | ok | {PART['setup'].seconds} | {PART['setup'].seconds} |" in (first / "summary.md").read_text()
    assert gpu_check.main(went_on.value.args[0][2:]) == 0
    assert ran[1:] == [("1B-3L headline", HEADLINE), ("golden losses", ()), ("layer", ())]
    text = (first / "summary.md").read_text()
    assert text.startswith("pre-checks:\n    ok    GPU: 1 listed by nvidia-smi\n")
    assert f"| setup | ok | {PART['setup'].seconds} | {PART['setup'].seconds} |" in text
    assert "| 1B-3L STEM-1/3 working set, lazy / dense | 0.90x | 1.00x | 0.95x | yes |" in text
    assert "| 1B-3L STEM-1/3 host, lazy Adam / dense | 0.90x | 1.00x | 0.95x | yes |" in text
    assert f"- {GOLDEN_LINE}" in text.splitlines()
    assert "| 350M STEM layer / dense FFN, forward + backward | 0.70x | 0.75x | 0.67x | yes |" in text
    assert "STEM-1/3 host / device tables" not in text and "| 1B STEM-1/3" not in text  # --all's, not planned
    assert "gpu tests" not in text and len(list(first.iterdir())) <= 7
    ran.clear()
    clock.until = clock.now + 600
    assert gpu_check.main(["--out", str(second), "--work", str(work), "--until", str(clock.until), "--resume",
                           "--all", "--set-up"]) == 0
    # 590 s: the gpu tests (130), 1B-3L's other variants (321), and of 350M's headline what its 139 s hold (20 + 35
    # + 72)
    assert ran == [("gpu tests", ()), ("1B-3L others", PART["1B-3L others"].variants),
                   ("350M headline", ("dense", "stem_1_3_resident_lazy"))]
    saved = json.loads((second / "gpu_step.json").read_text())
    assert sorted((r["model"], r["variant"]) for r in saved["records"]) == sorted(
        [("1B-3L", v) for v in HEADLINE + PART["1B-3L others"].variants] + [("350M", "dense"),
                                                                              ("350M", "stem_1_3_resident_lazy")])
    text = (second / "summary.md").read_text()
    assert "| gpu tests | ok | 130 | 130 |" in text
    assert "| 1B headline | not run: 12 s left, its first run needs about 43 s | - | - |" in text
    assert "| stem-doctor | not run: 12 s left, it needs about 90 s | - | - |" in text
    assert "| 1B-3L STEM-1/3 host / device tables | 1.00x | 1.05x | - | yes |" in text
    assert "| 350M STEM-1/3 working set, lazy / dense | 0.90x | 1.00x | 0.95x | yes |" in text
    assert len(list(second.iterdir())) <= 7


def test_a_failed_setup_leaves_its_cause_in_the_summary_and_goes_no_further(tmp_path, monkeypatch):
    import gpu_check

    clock, ran = _Clock(), []
    _stand_ins(monkeypatch, clock, ran, setup_rc=2)
    clock.until = clock.now + 480
    assert gpu_check.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]) == 1
    assert ran == [("setup", ())]
    text = (tmp_path / "out" / "summary.md").read_text()
    assert "| prechecks | ok |" in text and f"| setup | exit 2 | {PART['setup'].seconds} |" in text


def test_the_prechecks_name_what_the_node_lacks_and_its_fix(tmp_path, monkeypatch):
    """No compiler and no ninja anywhere (an empty PATH, a Python without one beside it, no wheelhouse), and a
    /dev/shm smaller than the tables: a FAIL for each tool the setup's op build needs, a WARN for torch.compile and
    /dev/shm naming what fails and the fix."""
    import gpu_prechecks

    monkeypatch.setenv("PATH", str(tmp_path))
    for var in ("CC", "CXX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(gpu_prechecks.sys, "executable", str(tmp_path / "python3"))
    found = gpu_prechecks.checks(10**18, shm_dir=str(tmp_path), wheelhouse=str(tmp_path))
    assert gpu_prechecks.fatal(found) == ["GPU", "C++ compiler", "ninja"]
    lines = gpu_prechecks.lines(found)
    assert lines[1] == ("FAIL  C++ compiler: none (CXX, c++, g++): the row-Adam op cannot build; install g++ "
                        "(apt-get install g++) or set CXX")
    assert lines[3].startswith("WARN  torch.compile: no a C compiler (CC, cc, gcc, clang)")
    assert lines[4].startswith("WARN  /dev/shm: ") and "enlarge it" in lines[4]
    (tmp_path / "ninja-1.13.0-py3-none-manylinux_2_28_x86_64.whl").touch()
    assert gpu_prechecks.checks(0, shm_dir=str(tmp_path), wheelhouse=str(tmp_path))[2][0] == "ok"


def test_the_default_plan_fits_seven_minutes_with_its_setup_and_the_dry_run_prints_it(capsys):
    """The dry run prints every part with its planned seconds, each estimate's arithmetic under it, and the total;
    without --all that total, setup and summary included, is at most 7 minutes; --all appends the rest. It needs no
    GPU and no project (the system's Python prints it)."""
    import gpu_check

    def printed(argv):
        assert gpu_check.main(["--dry-run", *argv]) == 0
        lines = capsys.readouterr().out.splitlines()
        return lines, {line[:23].strip(): int(line[23:28]) for line in lines[1:] if line[23:28].strip()}

    lines, seconds = printed([])
    assert list(seconds)[:-2] == [p.name for p in PARTS] and list(seconds)[-2:] == ["summary", "total"]
    assert seconds["total"] == sum(v for k, v in seconds.items() if k != "total") <= BUDGET_S == 420
    assert seconds["setup"] == PART["setup"].seconds and seconds["summary"] == SUMMARY_S
    assert seconds["1B-3L headline"] == STEPS_START_S + sum(run_seconds("1B-3L", v) for v in HEADLINE)
    stripped = [line.strip() for line in lines]
    assert ("stem_1_3_resident_lazy: start (23) + 6 steps x 0.7 s (4) + 1.05G table params x 15.2 s/G (16) + "
            "working set compile (25) = 68") in stripped
    assert "pip from the wheelhouse 40 s + the row-Adam op build 65 s (first H100 run)" in stripped
    _, everything = printed(["--all"])
    assert list(everything)[:-2] == [p.name for p in PARTS + EXTRA] and everything["total"] > BUDGET_S
    proc = subprocess.run(["/usr/bin/python3", "-I", str(ROOT / "tools" / "gpu_check.py"), "--dry-run"],
                          capture_output=True, text=True, cwd=ROOT, env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert proc.returncode == 0 and proc.stdout.splitlines() == lines, proc.stderr


def test_the_parts_run_the_goals_figures_first_and_every_gpu_test_once():
    """The default plan holds the step figures at 1B width (STEM-1/3 with a working set and host tables against
    dense), then the golden losses and the layer's figures; every goal's two runs are in some part of its model; every test of
    tests/test_gpu.py is in one tests part, the doctor's excepted (the doctor part runs stem-doctor itself); the
    files a command writes stay within a lease's 8."""
    assert [p.name for p in PARTS] == ["prechecks", "setup", "1B-3L headline", "golden losses", "layer"]
    assert [p.name for p in EXTRA][:2] == ["gpu tests", "1B-3L others"]
    assert HEADLINE == ("dense", "stem_1_3_resident_lazy", "stem_1_3_host_lazy")
    runs = {(p.model, v) for p in PARTS + EXTRA if p.kind == "steps" for v in p.variants}
    for figure, model, top, bottom, *_ in GOALS:
        assert {(model, top), (model, bottom)} <= runs, (model, figure)
    source = ast.parse((ROOT / "tests" / "test_gpu.py").read_text())
    tests = [node.name for node in source.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
    assert sorted(GPU_ONLY + TRAINING + (DOCTOR_TEST,)) == sorted(tests)
    assert len({p.log for p in PARTS + EXTRA if p.log}) + 4 <= 8  # with gpu_step.json, 2 audits and summary.md


def test_every_planned_run_s_tables_fit_the_lent_machine_s_host():
    """The host-table runs the parts plan (STEM layers x V x d_ff fp32 rows and two moments, by the recipes' shapes
    and the variant's ratio) fit the lent machine's 128 GiB; 1B-3L's build one or two layers' 12.6 GB; the plan's
    shapes are the recipes'."""
    from benchmarks.gpu_step import SHAPES, VARIANTS

    from stem_megatron.layer_plan import stem_layer_indices
    from stem_megatron.recipes import compose_run

    models = {m.name: compose_run(list(m.overrides)).model for m in SHAPES["paper"].models}
    assert {name: (m.num_layers, m.vocab_size, m.ffn_hidden_size) for name, m in models.items()} == {
        name: shape[:3] for name, shape in MODELS.items()}
    tables = {}
    for part in PARTS + EXTRA:
        for variant in part.variants:
            overrides = VARIANTS[variant][1]
            if "host_tables.placement=host" in overrides:
                m = models[part.model]
                layers = stem_layer_indices(m.num_layers, "full" if "variant=stem_full" in overrides else "1/3")
                tables[part.model, variant] = len(layers) * m.vocab_size * m.ffn_hidden_size * 4 * 3
    assert max(tables.values()) <= 128 * 2**30, tables
    assert tables["1B-3L", "stem_1_3_host_lazy"] == 128256 * 8192 * 12
    assert tables["1B-3L", "stem_full_resident_lazy"] == 2 * 128256 * 8192 * 12


# a part standing in for gpu_step: it starts a grandchild in a session of its own that ignores SIGTERM (as torch
# elastic starts its workers), then exits at once ("exits") or sleeps (ended by SIGTERM, as gpu_step was)
STAND_IN = """
import os, subprocess, sys, time
where, mode = sys.argv[1], sys.argv[2]
grandchild = (
    "import os, signal, sys, time\\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
    "open(sys.argv[1] + '/grandchild.tmp', 'w').write(str(os.getpid()))\\n"
    "os.replace(sys.argv[1] + '/grandchild.tmp', sys.argv[1] + '/grandchild.pid')\\n"
    "time.sleep(120)\\n")
subprocess.Popen([sys.executable, "-c", grandchild, where], start_new_session=True)
while not os.path.exists(where + "/grandchild.pid"):
    time.sleep(0.01)
open(where + "/part.tmp", "w").write(str(os.getpid()))
os.replace(where + "/part.tmp", where + "/part.pid")
if mode != "exits":
    time.sleep(120)
"""
# gpu_check.main with the stand-in as its one part (stopped after 1 s where it "times out"), a short grace, and a GPU
# listed (the doctor's module stood in for: no torch to import)
CHECK = """
import sys
sys.path.insert(0, "tools")
import gpu_check
where, mode, stand_in = sys.argv[1:4]
gpu_check.GRACE_S = 0.5
gpu_check.PARTS = (gpu_check.Part("stand-in", "layer", "stand_in.log", 1, 1 if mode == "times out" else 60),)
gpu_check.command = lambda *args: [sys.executable, "-c", stand_in, where, mode]
sys.exit(gpu_check.main(["--out", where + "/out", "--work", where + "/work", "--set-up"]))
"""
# gpu_step with the stand-in as its run
STEP = """
import sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
import gpu_step
where, mode, stand_in = sys.argv[1:4]
gpu_step.GRACE_S = 0.5
gpu_step.take_charge()
gpu_step.launch([sys.executable, "-c", stand_in, where, mode], Path(where) / "run.log", 60)
"""


def _running(marker: str) -> list[int]:
    """The processes whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker in Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("driver, mode, code", [
    pytest.param(CHECK, "exits", 0, id="gpu_check-part-ends"),
    pytest.param(CHECK, "times out", 1, id="gpu_check-part-times-out"),
    pytest.param(CHECK, "stopped", 143, id="gpu_check-sigterm"),
    pytest.param(STEP, "stopped", 143, id="gpu_step-sigterm", marks=pytest.mark.slow),  # gpu_step imports torch
])
def test_no_process_of_a_part_outlives_it(tmp_path, driver, mode, code):
    """A part whose grandchild ignores SIGTERM in a session of its own, left behind as the part exits, stopped at
    the part's cap, or stopped with gpu_check (or gpu_step) by SIGTERM: when the command has ended, no process of
    the part is there any more, not even unreaped; gpu_check's summary says how the part ended. Whatever fails,
    nothing of the test is left running (the finally ends every process naming its folder)."""
    where = str(tmp_path)
    command = subprocess.Popen([sys.executable, "-c", driver, where, mode, STAND_IN], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        files = [tmp_path / "grandchild.pid", tmp_path / "part.pid"]
        deadline = time.monotonic() + 60
        while not all(f.exists() for f in files) and command.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        pids = [int(f.read_text()) for f in files if f.exists()]
        if mode == "stopped" and len(pids) == 2:
            command.send_signal(signal.SIGTERM)
        output = command.communicate(timeout=60)[0]
        assert len(pids) == 2 and command.returncode == code, output
        assert [pid for pid in pids if Path(f"/proc/{pid}").exists()] == [], output
        assert _running(where) == []
        if driver == CHECK:
            status = {"exits": "ok", "times out": "timed out", "stopped": "stopped (SIGTERM)"}[mode]
            assert f"| stand-in | {status} |" in (tmp_path / "out" / "summary.md").read_text()
    finally:
        command.kill()
        command.wait()
        for pid in _running(where):
            os.kill(pid, signal.SIGKILL)


def test_a_failing_gpu_test_s_report_is_written_as_it_happens(tmp_path):
    """The tests part's pytest (its command: gpu_check's own hook loaded): a failure's report is in the log while
    the next test still runs, so a part stopped at its cap keeps it; each test's verdict comes as it ends."""
    import gpu_check

    (tmp_path / "test_stand_in.py").write_text(
        "import time\n\n\ndef test_fails():\n    assert 1 + 1 == 3, 'the report'\n\n\n"
        "def test_runs_on():\n    time.sleep(120)\n")
    part = gpu_check.Part("gpu tests", "tests")
    cmd = [*gpu_check.command(part, (), None, None, tmp_path / "unused"), str(tmp_path / "test_stand_in.py")]
    log = tmp_path / "gpu_tests.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 60
        while "test_runs_on" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        text = log.read_text()
        assert "test_stand_in.py::test_fails FAILED" in text, text
        assert "test_stand_in.py::test_fails failed (call)" in text and "AssertionError: the report" in text, text
        assert "short test summary" not in text, text  # not pytest's summary at the end: the session runs on
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_the_gpu_tests_scripts_run_on_the_cpu():
    """The scripts of tests/test_gpu.py's SDPA and sync tests, at small shapes on the CPU: SDPA with torch's CPU
    flash kernel as its only backend, and the STEM layer, slot AdamW and landing copy (no sync debug mode there),
    so that a lent GPU's minutes are not lost to a script that cannot run."""
    from test_gpu import SDPA_FLASH, SYNC_FREE

    scripts = ((SDPA_FLASH, ["cpu", "128"]), (SYNC_FREE, ["cpu", "64", "2", "32", "40"]))
    both = "import sys\n" + "".join(f"sys.argv = {['-c', *args]!r}\nexec({script!r}, {{'__name__': '__main__'}})\n"
                                    for script, args in scripts)  # one process: one start, one import of torch
    proc = subprocess.run([sys.executable, "-c", both], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0 and proc.stdout.split() == ["flash", "no", "sync"], proc.stdout + proc.stderr[-3000:]


def test_gpu_check_refuses_a_machine_without_a_gpu(tmp_path):
    """No nvidia-smi on the PATH (as on this CI machine; hidden here on a GPU node too): one line, exit 2."""
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py")], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "gpu-check: no GPU here (nvidia-smi lists none): run it on a GPU node (docs/gpu.md)")
