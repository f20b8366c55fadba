#!/usr/bin/env python3
"""``make gpu-check``: the GPU path checked on a GPU machine, most telling part first, inside a deadline.

A lent GPU comes for minutes (15 in all, at most 10 a command, the machine's start included), so the check is a
list of parts in the order of what they tell, planned to fit 7 minutes with the setup before it (``--dry-run``
prints the plan: every part, its planned seconds and the total), and ``--until`` (a deadline, seconds since the
epoch) makes it run what fits and say what it left (``PARTS``): the setup (``make setup``, run before this script,
timed from ``--since``); the ``gpu``-marked tests that only a GPU can fail and that take seconds (``GPU_ONLY``),
each failure's report in gpu_tests.log as it happens; ``benchmarks/gpu_step.py`` at ``1B-3L``, the 1B recipe's
widths with 3 of its 16 layers (a STEM layer against a dense one, with one or two layers' tables to build where 16
layers need 63 GB, or 189 GB for STEM-full, more than the lent machine's 128 GiB): dense, STEM-1/3 with a working
set and with host tables, STEM-full with a working set; ``benchmarks/stem_layer.py``. ``--all`` adds the rest
after them (``EXTRA``): the gpu tests that train, the other variants at 1B-3L, 350M, 1B at 16 layers (STEM-full
left out) and ``stem-doctor --steps 5``.

A step run starts only with the time its estimate asks left (``RUN_S``), and a part runs as many of its variants
as fit. Step 3 of every run is audited (``logging.sync_audit``: the synchronising CUDA calls by thread and call site;
``logging.collective_audit``: every collective in order, and whether the ranks agree); the first ``--warmup`` steps
and the profiled last one are left out of the timings. Every process a part starts ends with it
(``benchmarks/process_tree.py``): at its end, its cap or a SIGTERM to this script, each is sent SIGTERM, given
``GRACE_S``, then SIGKILL, torchrun's workers in sessions of their own included.

``--resume`` (a second command on the same machine) keeps what earlier commands measured under ``--work`` and runs
only what they did not reach. The folder (``OUT``, default runs/gpu-check-<time>) holds at most 8 files: doctor.log,
gpu_tests.log, layer.log, gpu_step.log, gpu_step.json (every record so far, the layer's results and each part's
seconds), sync_audit.txt and collective_audit.json (of the first audited run in ``AUDITED``), and summary.md: the
figures against the GPU step's goals (issue 31; docs/gpu.md, "make gpu-check") as ratios of one machine's runs, then
each part's status and seconds against its estimate (``tools/gpu_goals.py``). ``BASELINE=<an earlier gpu_step.json>`` adds its figures
beside (e.g. main before a change).

Run: ``make gpu-check [OUT=dir] [UNTIL=epoch] [RESUME=1] [ALL=1] [BASELINE=file] [DRY_RUN=1] [OVERRIDES=...]``,
or ``.venv/bin/python tools/gpu_check.py --out DIR [--until EPOCH] [--resume] [--all] [--dry-run] [overrides]``; on
a lent machine: docs/gpu.md, "A lent GPU".
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.process_tree import Stopped, confined, take_charge  # noqa: E402
from stem_megatron.setup_check import require_environment  # noqa: E402
from tools.gpu_goals import goal_rows, summary  # noqa: E402

if "--dry-run" not in sys.argv[1:]:  # the dry run is stdlib only: any Python prints the plan
    require_environment()  # another Python gets `make setup`, not a traceback

AUDIT_STEP = 3
BUDGET_S = 420  # the plan without --all, setup included: 7 of a lent machine's 15 minutes
SETUP_S = 85  # `make setup` offline: ~30 s of pip from the wheelhouse, ~55 s of op builds on 16 cores (the GPU kit's)
# seconds one gpu_step run takes with its start-up, for planning (summary.md prints what each part took, to correct
# them). 1B: one host-table run at 16 layers took 123 s on an H100 before issue 26, most of it building 5 STEM
# layers' tables (~16 s a layer: 12.6 GB of fp32 rows and moments drawn and mapped), ~20 s its 6 steps, the rest
# the start (torchrun, imports, the first step's compiles). 1B-3L: the same start, 6 steps of 3 layers (~4 s), and
# 0 (dense), 1 (STEM-1/3) or 2 (STEM-full) layers' tables: 25 to 55 s, 40 on average. 350M: not yet timed.
RUN_S = {"1B-3L": 40, "1B": 125, "350M": 55}
RUN_CAP_S = 240  # one step run is stopped after this
STEPS_START_S = 20  # a steps part's own start: imports, the GPU's properties, its corpus
SUMMARY_S = 10  # kept back from the deadline for the summary
GRACE_S = 20  # a part stopped: SIGTERM to its processes, then SIGKILL after this
DOCTOR_TEST = "test_doctor_trains_on_the_gpu_as_on_the_cpu"  # run as the doctor part, not as a test
# tests/test_gpu.py: what no CPU test can fail, in seconds each, most telling first
GPU_ONLY = ("test_a_working_set_on_the_gpu_trains_its_rows_as_the_cpu_and_pins_nothing_after_it_is_built",
            "test_the_stem_layer_slot_adam_and_a_landing_copy_never_synchronise_the_device",
            "test_sdpa_takes_the_flash_kernel_at_1b_shapes",
            "test_pinned_staging_delivers_every_fetch_intact",
            "test_pinned_blocks_are_what_the_memory_plan_counts",
            "test_row_gradients_land_on_the_host_intact",
            "test_two_threads_fetching_through_one_store_get_the_host_rows")
# the rest: torchrun trainings of the demo (a cold compile each) and the sanitizer's runs, minutes
TRAINING = ("test_gpu_training_with_host_tables_learns_and_a_working_set_trains_alike",
            "test_an_audited_host_table_step_with_validation_beside_it",
            "test_the_working_set_s_streams_pass_the_cuda_sanitizer",
            "test_a_host_table_step_with_its_prefetch_and_cpu_adam_passes_the_cuda_sanitizer")
# the audits kept in OUT: the first of these runs that wrote them
AUDITED = (("1B-3L", "stem_1_3_resident_lazy"), ("350M", "stem_1_3_resident_lazy"), ("1B", "stem_1_3_resident_lazy"),
           ("350M", "stem_1_3_host_lazy"))


@dataclass(frozen=True)
class Part:
    """One part of the check: a command (``kind`` setup | tests | steps | layer | doctor), its log in OUT, and the
    seconds it is planned at (a steps part: ``RUN_S`` per run) and stopped after. A setup part runs before this
    script (``make setup``): it is planned and timed here, not run."""

    name: str
    kind: str
    log: str = ""
    seconds: int = 0
    cap: int = 0
    model: str = ""
    variants: tuple[str, ...] = ()
    tests: tuple[str, ...] = ()

    def planned(self, runs: int) -> int:
        """The seconds the part is planned at with ``runs`` of its step runs."""
        return STEPS_START_S + RUN_S[self.model] * runs if self.kind == "steps" else self.seconds

    def what(self) -> str:
        """The part in a few words, for the dry run."""
        if self.kind == "steps":
            return (f"benchmarks/gpu_step.py {self.model}: {', '.join(self.variants)} ({STEPS_START_S} s + "
                    f"{len(self.variants)} x {RUN_S[self.model]} s)")
        return {"setup": "make setup (offline: a wheelhouse on the node's torch) and the CPU Adam op builds, before "
                         "this script",
                "tests": f"{len(self.tests)} tests of tests/test_gpu.py", "layer": "benchmarks/stem_layer.py",
                "doctor": "stem-doctor --steps 5"}[self.kind]


PARTS = (  # fits BUDGET_S with SUMMARY_S
    Part("setup", "setup", seconds=SETUP_S),
    Part("gpu tests", "tests", "gpu_tests.log", 100, 150, tests=GPU_ONLY),
    Part("1B-3L headline", "steps", "gpu_step.log", model="1B-3L",
         variants=("dense", "stem_1_3_resident_lazy", "stem_1_3_host_lazy", "stem_full_resident_lazy")),
    Part("layer", "layer", "layer.log", 45, 120),
)
EXTRA = (  # --all, after PARTS
    Part("gpu tests, training", "tests", "gpu_tests.log", 300, 420, tests=TRAINING),
    Part("1B-3L others", "steps", "gpu_step.log", model="1B-3L",
         variants=("stem_1_3_device", "stem_full_host", "stem_1_3_resident_dense", "stem_1_3_host_dense")),
    Part("350M headline", "steps", "gpu_step.log", model="350M",
         variants=("dense", "stem_1_3_resident_lazy", "stem_1_3_host_lazy", "stem_full_resident_lazy")),
    Part("1B headline", "steps", "gpu_step.log", model="1B",
         variants=("dense", "stem_1_3_resident_lazy", "stem_1_3_resident_fit", "stem_1_3_host_lazy")),
    Part("350M others", "steps", "gpu_step.log", model="350M",
         variants=("stem_1_3_resident_fit", "stem_full_host", "stem_1_3_device", "stem_1_3_resident_dense",
                   "stem_1_3_host_dense")),
    Part("1B others", "steps", "gpu_step.log", model="1B",
         variants=("stem_1_3_device", "stem_1_3_resident_dense", "stem_1_3_host_dense")),
    Part("stem-doctor", "doctor", "doctor.log", 90, 120),
)

def plan_part(part: Part, state: dict, left: Optional[float]) -> tuple[Optional[tuple[str, ...]], str]:
    """What of ``part`` to run with ``left`` seconds (None: no deadline), after what ``state`` holds from earlier
    commands: (None and why, or the variants to run: those of a steps part not measured yet that fit, () for a part
    without variants)."""
    if part.kind != "steps":
        if not state["parts"].get(part.name, {}).get("status", "not run").startswith("not run"):
            return None, "ran earlier"
        if left is not None and left < part.seconds:
            return None, f"not run: {left:.0f} s left, it needs about {part.seconds} s"
        return (), ""
    measured = {r["variant"] for r in state["records"] if r["model"] == part.model and r["status"] != "not run"}
    missing = tuple(v for v in part.variants if v not in measured)
    if not missing:
        return None, "ran earlier"
    fit = len(missing) if left is None else max((n for n in range(1, len(missing) + 1) if part.planned(n) <= left), default=0)
    if fit == 0:
        return None, f"not run: {left:.0f} s left, a run needs about {RUN_S[part.model]} s"
    return missing[:fit], ""


def merge_records(state: dict, new: list[dict]) -> None:
    """``new`` records replace the state's of the same model and variant (a rerun's figures win)."""
    keys = {(r["model"], r["variant"]) for r in new}
    state["records"] = [r for r in state["records"] if (r["model"], r["variant"]) not in keys] + new


def step(name: str, cmd: list[str], log: Path, timeout: Optional[float]) -> tuple[int, float]:
    """Run one part, its output appended to ``log``; every process it started ends with it (``confined``: at its
    end, at ``timeout``, or when this script gets SIGTERM); (exit code, -1 on timeout; seconds)."""
    print(f"gpu-check: {name} ...", flush=True)
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "a") as out, confined(GRACE_S):
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = -1  # SIGTERM to it and all it started, SIGKILL after GRACE_S: confined's end
    seconds = time.perf_counter() - start
    print(f"gpu-check: {name}: {'timed out' if rc == -1 else f'exit {rc}'} after {seconds:.0f} s ({log.name})",
          flush=True)
    return rc, seconds


def command(part: Part, variants: tuple[str, ...], args, until: Optional[float], results: Path) -> list[str]:
    """The part's command line; a steps part writes its records, the layer part its results, to ``results``."""
    python = sys.executable
    if part.kind == "tests":  # each verdict as it comes, each failure's report too (this module's hook)
        return [python, "-m", "pytest", "-p", "tools.gpu_check", "-p", "no:cacheprovider", "-vv", "-rfE",
                "--tb=short", *(f"tests/test_gpu.py::{test}" for test in part.tests)]
    if part.kind == "layer":
        return [python, "benchmarks/stem_layer.py", "--json", str(results)]
    if part.kind == "doctor":
        return [python, "-m", "stem_megatron.doctor.cli", "--steps", "5"]
    return [python, "benchmarks/gpu_step.py", "--shapes", "paper", "--models", part.model, "--variants",
            ",".join(variants), "--steps", str(args.steps), "--warmup", str(args.warmup), "--timeout",
            str(RUN_CAP_S), *(["--until", f"{until:.0f}"] if until else []), "--out", str(args.work), "--json",
            str(results), f"logging.sync_audit={AUDIT_STEP}",
            f"logging.collective_audit={AUDIT_STEP}", *args.overrides]


def plan(parts: tuple[Part, ...]) -> str:
    """The dry run: every part with its planned seconds, then the total."""
    rows = [(p.name, p.planned(len(p.variants)), p.what()) for p in parts]
    rows.append(("summary", SUMMARY_S, "kept back from the deadline"))
    total = sum(seconds for _, seconds, _ in rows)
    lines = ["gpu-check plan (seconds planned on one H100/H200 with 16 cores):",
             *(f"  {name:<20} {seconds:>5}  {what}" for name, seconds, what in rows),
             f"  {'total':<20} {total:>5}  ({total / 60:.1f} min"
             + (")" if total <= BUDGET_S else f"; more than one command's {BUDGET_S} s)")]
    return "\n".join(lines) + "\n"


_pytest_config = None


def pytest_configure(config) -> None:
    """The tests part loads this module into its pytest (``-p tools.gpu_check``): the config, for the hook below."""
    global _pytest_config
    _pytest_config = config


def pytest_runtest_logreport(report) -> None:
    """A failure's report printed as it happens, not only at the session's end: a tests part stopped at its cap
    keeps every report so far."""
    if report.failed:
        reporter = _pytest_config.pluginmanager.get_plugin("terminalreporter")
        reporter.write_sep("_", f"{report.nodeid} failed ({report.when})")
        reporter.write_line(report.longreprtext)


def audits(work: Path, out: Path) -> dict:
    """The first audited run's sync and collective audits, copied into ``out``; one line each for the summary."""
    for model, variant in AUDITED:
        run = work / model / variant
        sync = run / f"sync_audit_step{AUDIT_STEP}_rank0.txt"
        if not sync.exists():
            continue
        shutil.copy(sync, out / "sync_audit.txt")
        lines = {"sync": f"{model} {variant}, step {AUDIT_STEP}: {sync.read_text().splitlines()[0]} (sync_audit.txt)"}
        collective = run / f"collective_audit_step{AUDIT_STEP}.json"
        if collective.exists():
            shutil.copy(collective, out / "collective_audit.json")
            lines["collectives"] = json.loads(collective.read_text())["summary"] + " (collective_audit.json)"
        return lines
    return {"sync": f"no sync audit: none of {', '.join(' '.join(a) for a in AUDITED)} ran (gpu_step.log)"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="the results' folder (default runs/gpu-check-<time>)")
    ap.add_argument("--work", type=Path, default=REPO / "runs" / "gpu-check-work", help="the runs and their corpora")
    ap.add_argument("--until", type=float, default=None,
                    help="a deadline, seconds since the epoch (e.g. $(( $(date +%%s) + 480 ))): parts that do not "
                         "fit are left, and the summary is written by then")
    ap.add_argument("--since", type=float, default=None,
                    help="when the command started, seconds since the epoch (make gpu-check passes it): the setup "
                         "before this script is timed from it")
    ap.add_argument("--all", action="store_true", help="after the 7 minutes' parts, the rest (EXTRA)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (parts, planned seconds, total) and exit")
    ap.add_argument("--resume", action="store_true", help="keep what earlier commands measured under --work")
    ap.add_argument("--baseline", type=Path, default=None, help="an earlier run's gpu_step.json, shown beside")
    ap.add_argument("--steps", type=int, default=6, help="steps per gpu_step run (default 6)")
    ap.add_argument("--warmup", type=int, default=AUDIT_STEP, help="steps left out of the timings (default 3)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every step run, e.g. "
                                                 "host_tables.host_memory_gib=110 on a VM whose RAM grows as it is "
                                                 "used (docs/gpu.md, A lent GPU)")
    args = ap.parse_args(argv)
    parts = PARTS + (EXTRA if args.all else ())
    if args.dry_run:  # stdlib only: any Python, before setup
        print(plan(parts), end="")
        return 0
    from stem_megatron.doctor.cuda import nvidia_smi_gpus

    if not nvidia_smi_gpus():
        print("gpu-check: no GPU here (nvidia-smi lists none): run it on a GPU node (docs/gpu.md)", file=sys.stderr)
        return 2
    if args.warmup < AUDIT_STEP or args.steps < args.warmup + 2:
        ap.error(f"need --warmup >= {AUDIT_STEP} (the audited step stays out of the timings) and --steps >= "
                 f"--warmup + 2")
    take_charge()  # the parts' orphans come here, and a SIGTERM ends the running part's processes first
    baseline = json.loads(args.baseline.read_text()) if args.baseline else None
    out = args.out or REPO / "runs" / f"gpu-check-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    state_file = args.work / "gpu_check_state.json"
    state = json.loads(state_file.read_text()) if args.resume and state_file.exists() else {
        "parts": {}, "records": [], "layer": []}
    until = None if args.until is None else args.until - SUMMARY_S
    stopped = False
    try:
        for part in parts:
            if part.kind == "setup":
                state["parts"][part.name] = {"status": "ok", "seconds": time.time() - args.since,
                                             "planned": part.seconds} if args.since else {
                    "status": "not timed (no --since)", "planned": part.seconds}
                continue
            left = None if until is None else until - time.time()
            variants, why = plan_part(part, state, left)
            if variants is None:
                if why != "ran earlier":
                    state["parts"][part.name] = {"status": why}
                continue
            planned = part.planned(len(variants))
            state["parts"][part.name] = {"status": "stopped (SIGTERM)", "planned": planned}  # until it ends
            cap = RUN_CAP_S * len(variants) if part.kind == "steps" else part.cap
            timeout = cap if left is None else min(cap, left + 20)  # a steps part stops its own runs by --until
            results = args.work / f"{part.name.replace(' ', '_')}.json"
            results.unlink(missing_ok=True)  # only this command's
            try:
                rc, seconds = step(part.name, command(part, variants, args, until, results), out / part.log,
                                   timeout)
                state["parts"][part.name] = {"status": "ok" if rc == 0 else "timed out" if rc == -1 else
                                             f"exit {rc}", "seconds": seconds, "planned": planned}
            finally:  # stopped by SIGTERM too: what the part finished counts
                if results.exists() and part.kind == "steps":
                    merge_records(state, json.loads(results.read_text())["records"])
                if results.exists() and part.kind == "layer":
                    state["layer"] = json.loads(results.read_text())
                state_file.write_text(json.dumps(state, indent=2) + "\n")
    except Stopped:  # the part's processes have ended (step's confined): the summary of what ran, then exit 143
        stopped = True
        print("gpu-check: stopped by SIGTERM", file=sys.stderr, flush=True)
    (out / "gpu_step.json").write_text(json.dumps({"date": str(datetime.date.today()), **state}, indent=2) + "\n")
    planned = {(p.model, v) for p in parts for v in p.variants}
    text = summary(goal_rows(state, baseline, planned), state["parts"], audits(args.work, out), baseline is not None)
    (out / "summary.md").write_text(text)
    print(f"\n{text}results: {out}", flush=True)
    failed = [p for p in state["parts"].values() if p["status"] != "ok" and not p["status"].startswith("not ")]
    return Stopped().code if stopped else 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
