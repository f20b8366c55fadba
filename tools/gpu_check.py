#!/usr/bin/env python3
"""``make gpu-check``: the GPU path checked in one command on a GPU machine, every result in one folder.

1. ``stem-doctor --steps 5``: the environment, and the tiny model trained on the GPU against the CPU;
2. the ``gpu``-marked tests (tests/test_gpu.py) but the doctor's, which part 1 ran;
3. ``benchmarks/gpu_step.py`` at the paper's shapes (350M and 1B, 32,768 tokens a step): dense, STEM-1/3 with host
   tables (lazy CPU Adam), STEM-full with host tables, STEM-1/3 with device tables where the memory plan says
   they fit, and STEM-1/3 and STEM-full with a working set on the device (``stem.resident_rows``); step 3 of every run audited (``logging.sync_audit``: the synchronising CUDA calls by thread and call
   site; ``logging.collective_audit``: every collective in order, and whether the ranks agree), the first
   ``--warmup`` steps and the profiled last one left out of the timings;
4. the figures against the GPU step's goals (docs/benchmarks.md, "GPU step goals"), as ratios in one table.

The folder (``OUT``, default runs/gpu-check-<time>) holds at most 7 files: doctor.log, gpu_tests.log, gpu_step.log,
gpu_step.json, sync_audit.txt and collective_audit.json (350M STEM-1/3 host, rank 0), and summary.md (the table).
The runs themselves go to ``--work``. Its parts stop at 2, 2.5 and 9 minutes; together they are planned to take
about 9 minutes on one H100 with 16 cores (an estimate: not yet timed there). ``BASELINE=<an earlier
gpu_step.json>`` adds its figures beside these (e.g. main before a change).

Run: ``make gpu-check [OUT=dir] [BASELINE=file]``, or ``.venv/bin/python tools/gpu_check.py --out DIR``.
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
from stem_megatron.setup_check import require_environment  # noqa: E402

require_environment()  # another Python gets `make setup`, not a traceback

AUDIT_STEP = 3
VARIANTS = ("dense", "stem_1_3_host_lazy", "stem_full_host", "stem_1_3_device", "stem_1_3_resident_lazy",
            "stem_full_resident_lazy")
AUDITED = ("350M", "stem_1_3_host_lazy")  # the run whose audits the folder keeps
# (figure, model, numerator variant, denominator variant, what is compared, at most, goal): issue 31's acceptance
GOALS = (
    ("STEM-1/3 host, lazy Adam / dense", "350M", "stem_1_3_host_lazy", "dense", "step_time_s", 1.00, 0.95),
    ("STEM-1/3 host, lazy Adam / dense", "1B", "stem_1_3_host_lazy", "dense", "step_time_s", 1.00, 0.95),
    ("STEM-full host / dense", "350M", "stem_full_host", "dense", "step_time_s", 0.90, 0.85),
    ("STEM-full host / dense", "1B", "stem_full_host", "dense", "step_time_s", 0.90, 0.85),
    ("STEM-1/3 host / device tables", "350M", "stem_1_3_host_lazy", "stem_1_3_device", "step_time_s", 1.05, None),
    ("STEM-1/3 host / device tables", "1B", "stem_1_3_host_lazy", "stem_1_3_device", "step_time_s", 1.05, None),
    ("STEM-1/3 host peak / dense peak", "1B", "stem_1_3_host_lazy", "dense", "peak_memory_bytes", 1.10, None),
    ("STEM-1/3 working set, lazy / dense", "350M", "stem_1_3_resident_lazy", "dense", "step_time_s", 1.00, 0.95),
    ("STEM-1/3 working set, lazy / dense", "1B", "stem_1_3_resident_lazy", "dense", "step_time_s", 1.00, 0.95),
    ("STEM-full working set, lazy / dense", "350M", "stem_full_resident_lazy", "dense", "step_time_s", 0.90, 0.85),
    ("STEM-full working set, lazy / dense", "1B", "stem_full_resident_lazy", "dense", "step_time_s", 0.90, 0.85),
    ("STEM-1/3 working set peak / dense peak", "1B", "stem_1_3_resident_lazy", "dense", "peak_memory_bytes", 1.10,
     None),
)


def goal_rows(records: list[dict], baseline: Optional[list[dict]] = None) -> list[dict]:
    """Each goal's measured ratio (None with the reason where a run is missing or failed), whether it is met, and
    the baseline's ratio where one is given."""

    def ratio(recs, model, top, bottom, key) -> tuple[Optional[float], str]:
        by = {r["variant"]: r for r in recs if r["model"] == model}
        missing = [v for v in (top, bottom) if v not in by or by[v]["status"] != "ok" or by[v].get(key) is None]
        if missing:
            run = by.get(missing[0])
            return None, f"{missing[0]}: {run['status'] if run else 'not run'}" + (
                f" ({run['note']})" if run and run.get("note") else "")
        return by[top][key] / by[bottom][key], ""

    rows = []
    for figure, model, top, bottom, key, most, goal in GOALS:
        value, why = ratio(records, model, top, bottom, key)
        before = ratio(baseline, model, top, bottom, key)[0] if baseline else None
        rows.append({"figure": f"{model} {figure}", "value": value, "why": why, "at_most": most, "goal": goal,
                     "met": None if value is None else value <= most, "before": before})
    return rows


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}x"


def summary(rows: list[dict], audits: dict, baseline: bool) -> str:
    """summary.md: the goals table, then the audits' lines."""
    head = "| figure | " + ("before | " if baseline else "") + "measured | at most | goal | met |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        cells = [r["figure"], *([_fmt(r["before"])] if baseline else []), _fmt(r["value"]) + (
            f" ({r['why']})" if r["why"] else ""), f"{r['at_most']:.2f}x", _fmt(r["goal"]), met]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *(f"- {line}" for line in audits.values())]
    return "\n".join(lines) + "\n"


def step(name: str, cmd: list[str], log: Path, timeout: float) -> tuple[int, float]:
    """Run one part, its output into ``log``; (exit code, -1 on timeout; seconds)."""
    print(f"gpu-check: {name} ...", flush=True)
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 15)  # SIGTERM: torchrun stops its workers (SIGKILL can leave one holding the GPU)
            proc.wait()
            rc = -1
    seconds = time.perf_counter() - start
    print(f"gpu-check: {name}: {'timed out' if rc == -1 else f'exit {rc}'} after {seconds:.0f} s ({log.name})",
          flush=True)
    return rc, seconds


def audits(work: Path, out: Path) -> dict:
    """The audited run's sync and collective audits, copied into ``out``; one line each for the summary."""
    model, variant = AUDITED
    run = work / model / variant
    lines = {}
    sync = run / f"sync_audit_step{AUDIT_STEP}_rank0.txt"
    if sync.exists():
        shutil.copy(sync, out / "sync_audit.txt")
        lines["sync"] = f"{model} {variant}, step {AUDIT_STEP}: {sync.read_text().splitlines()[0]} (sync_audit.txt)"
    else:
        lines["sync"] = f"{model} {variant}: no sync audit (the run failed: gpu_step.log)"
    collective = run / f"collective_audit_step{AUDIT_STEP}.json"
    if collective.exists():
        shutil.copy(collective, out / "collective_audit.json")
        lines["collectives"] = json.loads(collective.read_text())["summary"] + " (collective_audit.json)"
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="the results' folder (default runs/gpu-check-<time>)")
    ap.add_argument("--work", type=Path, default=REPO / "runs" / "gpu-check-work", help="the runs and their corpora")
    ap.add_argument("--baseline", type=Path, default=None, help="an earlier run's gpu_step.json, shown beside")
    ap.add_argument("--steps", type=int, default=6, help="steps per gpu_step run (default 6)")
    ap.add_argument("--warmup", type=int, default=AUDIT_STEP, help="steps left out of the timings (default 3)")
    args = ap.parse_args(argv)
    from stem_megatron.doctor.cuda import nvidia_smi_gpus

    if not nvidia_smi_gpus():
        print("gpu-check: no GPU here (nvidia-smi lists none): run it on a GPU node (docs/gpu.md)", file=sys.stderr)
        return 2
    if args.warmup < AUDIT_STEP or args.steps < args.warmup + 2:
        ap.error(f"need --warmup >= {AUDIT_STEP} (the audited step stays out of the timings) and --steps >= "
                 f"--warmup + 2")
    baseline = json.loads(args.baseline.read_text())["records"] if args.baseline else None
    out = args.out or REPO / "runs" / f"gpu-check-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    codes = {
        "stem-doctor": step("stem-doctor", [python, "-m", "stem_megatron.doctor.cli", "--steps", "5"],
                            out / "doctor.log", 120)[0],
        "gpu tests": step("gpu tests", [python, "-m", "pytest", "-q", "-m", "gpu", "-k", "not doctor",
                                        "tests/test_gpu.py"], out / "gpu_tests.log", 150)[0],
        "gpu_step": step("gpu_step (350M, 1B)", [
            python, "benchmarks/gpu_step.py", "--shapes", "paper", "--variants", ",".join(VARIANTS),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--timeout", "240", "--out", str(args.work),
            "--json", str(out / "gpu_step.json"), f"logging.sync_audit={AUDIT_STEP}",
            f"logging.collective_audit={AUDIT_STEP}"], out / "gpu_step.log", 540)[0],
    }
    step_json = out / "gpu_step.json"
    records = json.loads(step_json.read_text())["records"] if step_json.exists() else []
    text = summary(goal_rows(records, baseline), audits(args.work, out), baseline is not None)
    failed = [name for name, rc in codes.items() if rc != 0]
    text += "\n" + (f"parts that failed: {', '.join(failed)} (their logs)\n" if failed else "every part ran\n")
    (out / "summary.md").write_text(text)
    print(f"\n{text}results: {out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
