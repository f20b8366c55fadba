"""``make gpu-check``: the GPU path checked on a GPU machine, most telling part first, inside a deadline.

A lent GPU comes for minutes (15 in all, at most 10 a command, the machine's start included), so the check is a
list of parts in the order of what they tell (``tools/gpu_plan.py``: the parts, their seconds from measured figures
with the arithmetic, ``--dry-run`` prints it), planned to fit 7 minutes with its setup, and ``--until`` (a deadline,
seconds since the epoch) makes it run what fits and say what it left. The default plan: the pre-checks
(``tools/gpu_prechecks.py``, stdlib only, in seconds: a GPU, the compilers, Python.h, ninja, /dev/shm), then ``make
setup`` run by this script (its output in parts.log), then ``benchmarks/gpu_step.py`` at ``1B-3L``, the 1B recipe's
widths with 3 of its 16 layers (dense, STEM-1/3 with a working set and with host tables), then the golden losses
(``tools/golden_losses.py --check``: the tiny model's recorded CPU losses rerun in bf16). ``--all`` adds the rest
after them (``EXTRA``): the ``gpu``-marked tests that only a GPU can fail (``GPU_ONLY``, each failure's report in
gpu_tests.log as it happens), ``benchmarks/stem_layer.py``, the other variants at 1B-3L, the gpu tests that train
and import a Hugging Face model, 350M, 1B at 16 layers and ``stem-doctor --steps 5``.

The script starts on any Python (the node's, before the venv exists): the pre-checks and the setup run there, then it
goes on under the venv's Python (``--set-up``). ``summary.md`` is written after every part, so a failed pre-check or
setup leaves its cause in OUT. A step run starts only with the time its estimate asks left, and a part runs as many
of its variants as fit. Step 3 of every run is audited (``logging.sync_audit``; ``logging.collective_audit``); the
first ``--warmup`` steps and the profiled last one are left out of the timings. Every process a part starts ends
with it (``benchmarks/process_tree.py``): at its end, its cap or a SIGTERM to this script, each is sent SIGTERM, given
``GRACE_S``, then SIGKILL, torchrun's workers in sessions of their own included.

``--resume`` (a second command on the same machine) keeps what earlier commands measured under ``--work`` and runs
only what they did not reach. The folder (``OUT``, default runs/gpu-check-<time>) holds at most 7 files: parts.log
(the setup, golden losses, layer and doctor parts' output), gpu_tests.log, gpu_step.log, gpu_step.json (every record
so far, the layer's results and each part's seconds), sync_audit.txt and collective_audit.json (of the first audited
run in ``AUDITED``), and summary.md: the pre-checks, the figures against the GPU step's goals (docs/gpu.md, "make
gpu-check") as ratios of one machine's runs, the golden losses, then each part's status and seconds against its
estimate (``tools/gpu_goals.py``). ``BASELINE=<an earlier gpu_step.json>`` adds its figures beside.

Run: ``make gpu-check [OUT=dir] [UNTIL=epoch] [RESUME=1] [ALL=1] [BASELINE=file] [DRY_RUN=1] [OVERRIDES=...]``,
or ``python3 tools/gpu_check.py --out DIR [--until EPOCH] [--resume] [--all] [--dry-run] [overrides]``; on a lent
machine: docs/gpu.md, "A lent GPU".
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
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.process_tree import Stopped, confined, take_charge  # noqa: E402
from stem_megatron.setup_check import require_environment  # noqa: E402
from tools import gpu_prechecks  # noqa: E402
from tools.gpu_goals import goal_rows, summary  # noqa: E402
from tools.gpu_plan import (EXTRA, PARTS, PARTS_LOG, SUMMARY_S, Part, plan, plan_part,  # noqa: E402
                            table_params)

AUDIT_STEP = 3
RUN_CAP_S = 240  # one step run is stopped after this
GRACE_S = 20  # a part stopped: SIGTERM to its processes, then SIGKILL after this
# the audits kept in OUT: the first of these runs that wrote them
AUDITED = (("1B-3L", "stem_1_3_resident_lazy"), ("350M", "stem_1_3_resident_lazy"), ("1B", "stem_1_3_resident_lazy"),
           ("350M", "stem_1_3_host_lazy"))


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
    if part.kind == "setup":
        return ["make", "--no-print-directory", "setup"]
    if part.kind == "tests":  # each verdict as it comes, each failure's report too (this module's hook)
        return [python, "-m", "pytest", "-p", "tools.gpu_check", "-p", "no:cacheprovider", "-vv", "-rfE",
                "--tb=short", *(f"tests/test_gpu.py::{test}" for test in part.tests)]
    if part.kind == "golden":
        return [python, "tools/golden_losses.py", "--check", "--out", str(args.work / "golden")]
    if part.kind == "layer":
        return [python, "benchmarks/stem_layer.py", "--json", str(results)]
    if part.kind == "doctor":
        return [python, "-m", "stem_megatron.doctor.cli", "--steps", "5"]
    return [python, "benchmarks/gpu_step.py", "--shapes", "paper", "--models", part.model, "--variants",
            ",".join(variants), "--steps", str(args.steps), "--warmup", str(args.warmup), "--timeout",
            str(RUN_CAP_S), *(["--until", f"{until:.0f}"] if until else []), "--out", str(args.work), "--json",
            str(results), f"logging.sync_audit={AUDIT_STEP}",
            f"logging.collective_audit={AUDIT_STEP}", *args.overrides]


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


def golden_lines(out: Path) -> list[str]:
    """The golden-loss check's verdicts (its lines starting ``golden``) from parts.log."""
    log = out / PARTS_LOG
    return [line for line in log.read_text().splitlines() if line.startswith("golden ")] if log.exists() else []


def write_summary(state: dict, out: Path, parts: tuple[Part, ...], baseline: Optional[dict], work: Path) -> str:
    """summary.md as the parts so far leave it (rewritten after each part)."""
    (out / "gpu_step.json").write_text(json.dumps({"date": str(datetime.date.today()), **state}, indent=2) + "\n")
    planned = {(p.model, v) for p in parts for v in p.variants}
    notes = {**{f"golden {i}": line for i, line in enumerate(golden_lines(out))}, **audits(work, out)}
    text = ("pre-checks:\n" + "".join(f"    {line}\n" for line in state.get("prechecks", [])) + "\n"
            + summary(goal_rows(state, baseline, planned), state["parts"], notes, baseline is not None))
    (out / "summary.md").write_text(text)
    return text


def set_up(args, parts: tuple[Part, ...], state: dict, save) -> Optional[int]:
    """The pre-checks and ``make setup``, on whatever Python runs this; an exit code where they stop the check."""
    start = time.perf_counter()
    shm = max((gpu_prechecks.SHM_BYTES_PER_PARAM * table_params(p.model, v) for p in parts for v in p.variants
               if "device" not in v), default=0)  # the largest host tables a planned run builds
    found = gpu_prechecks.checks(shm, wheelhouse=os.environ.get("WHEELHOUSE"))
    state["prechecks"] = gpu_prechecks.lines(found)
    fatal = gpu_prechecks.fatal(found)
    state["parts"]["prechecks"] = {"status": f"FAIL: {', '.join(fatal)}" if fatal else "ok",
                                   "seconds": time.perf_counter() - start, "planned": parts[0].seconds}
    print("".join(f"gpu-check: {line}\n" for line in state["prechecks"]), end="", flush=True)
    save()
    if fatal:
        return 1
    setup = next(p for p in parts if p.kind == "setup")
    if plan_part(setup, state, None)[0] is None:
        return None  # ran earlier (--resume)
    rc, seconds = step(setup.name, command(setup, (), args, None, Path()), args.out / setup.log, setup.cap)
    state["parts"][setup.name] = {"status": "ok" if rc == 0 else "timed out" if rc == -1 else f"exit {rc}",
                                  "seconds": seconds, "planned": setup.seconds}
    save()
    if rc:
        print(f"gpu-check: setup failed ({state['parts'][setup.name]['status']}): see {args.out / setup.log}",
              file=sys.stderr)
        return 1
    return None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="the results' folder (default runs/gpu-check-<time>)")
    ap.add_argument("--work", type=Path, default=REPO / "runs" / "gpu-check-work", help="the runs and their corpora")
    ap.add_argument("--until", type=float, default=None,
                    help="a deadline, seconds since the epoch (e.g. $(( $(date +%%s) + 480 ))): parts that do not "
                         "fit are left, and the summary is written by then")
    ap.add_argument("--all", action="store_true", help="after the 7 minutes' parts, the rest (EXTRA)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (parts, planned seconds, total) and exit")
    ap.add_argument("--resume", action="store_true", help="keep what earlier commands measured under --work")
    ap.add_argument("--set-up", action="store_true", help="the pre-checks and setup ran (this script passes it on "
                                                          "to itself under the venv's Python)")
    ap.add_argument("--venv", type=Path, default=Path(os.environ.get("VENV", REPO / ".venv")),
                    help="the venv make setup builds (VENV; default .venv)")
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
    if args.warmup < AUDIT_STEP or args.steps < args.warmup + 2:
        ap.error(f"need --warmup >= {AUDIT_STEP} (the audited step stays out of the timings) and --steps >= "
                 f"--warmup + 2")
    if not args.set_up and not gpu_prechecks.gpus():
        print("gpu-check: no GPU here (nvidia-smi lists none): run it on a GPU node (docs/gpu.md)", file=sys.stderr)
        return 2
    args.out = args.out or REPO / "runs" / f"gpu-check-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    state_file = args.work / "gpu_check_state.json"
    state = json.loads(state_file.read_text()) if (args.resume or args.set_up) and state_file.exists() else {
        "parts": {}, "records": [], "layer": []}
    baseline = json.loads(args.baseline.read_text()) if args.baseline else None

    def save() -> None:
        state_file.write_text(json.dumps(state, indent=2) + "\n")
        write_summary(state, args.out, parts, baseline, args.work)

    if not args.set_up:
        stop = set_up(args, parts, state, save)
        if stop is not None:
            return stop
        python = args.venv / "bin" / "python"  # the rest under the venv's Python, with the project installed
        os.execv(python, [str(python), str(Path(__file__).resolve()), *argv, "--set-up", "--out", str(args.out)])
    require_environment()  # a venv without the project gets `make setup`, not a traceback
    take_charge()  # the parts' orphans come here, and a SIGTERM ends the running part's processes first
    until = None if args.until is None else args.until - SUMMARY_S
    stopped = False
    try:
        for part in parts:
            if part.kind in ("prechecks", "setup"):
                continue
            left = None if until is None else until - time.time()
            variants, why = plan_part(part, state, left)
            if variants is None:
                if why != "ran earlier":
                    state["parts"][part.name] = {"status": why}
                continue
            planned = part.planned(variants if part.kind == "steps" else None)
            state["parts"][part.name] = {"status": "stopped (SIGTERM)", "planned": planned}  # until it ends
            cap = RUN_CAP_S * len(variants) if part.kind == "steps" else part.cap
            timeout = cap if left is None else min(cap, left + 20)  # a steps part stops its own runs by --until
            results = args.work / f"{part.name.replace(' ', '_')}.json"
            results.unlink(missing_ok=True)  # only this command's
            try:
                rc, seconds = step(part.name, command(part, variants, args, until, results), args.out / part.log,
                                   timeout)
                state["parts"][part.name] = {"status": "ok" if rc == 0 else "timed out" if rc == -1 else
                                             f"exit {rc}", "seconds": seconds, "planned": planned}
            finally:  # stopped by SIGTERM too: what the part finished counts
                if results.exists() and part.kind == "steps":
                    merge_records(state, json.loads(results.read_text())["records"])
                if results.exists() and part.kind == "layer":
                    state["layer"] = json.loads(results.read_text())
                save()
    except Stopped:  # the part's processes have ended (step's confined): the summary of what ran, then exit 143
        stopped = True
        print("gpu-check: stopped by SIGTERM", file=sys.stderr, flush=True)
    state_file.write_text(json.dumps(state, indent=2) + "\n")
    text = write_summary(state, args.out, parts, baseline, args.work)
    print(f"\n{text}results: {args.out}", flush=True)
    failed = [p for p in state["parts"].values() if p["status"] != "ok" and not p["status"].startswith("not ")]
    return Stopped().code if stopped else 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
