"""Reproduction study v2 (one command): arms of Hydra sweeps, each run scored, docs/results.md written.

* main: dense, STEM-1/3, 1/2, full, STEM†, STEM-gate and Hash-MoE-1/3 (``-m variant=... train.seed=...``);
* ablation: STEM-1/3 with ``stem.table_init=scaled,xavier host_tables.clip=global,separate
  host_tables.optimizer=lazy,dense``;
* stress: dense, STEM-1/3 and Hash-MoE at ``--stress-lr`` (several times the recipe's peak), counting loss spikes;
* lean (only when named, alone or with others): ``--lean-variants`` (STEM-1/3 and STEM-full) with
  ``table_state=`` ``--lean-states`` (fp32 and lean; moments and bf16_master too, one lean setting each), the
  tables' lean optimizer state against fp32 AdamW; its section of the report (``benchmarks/study_lean.py``) is its
  own and compares every finished lean run, those of earlier commands with other lists included.

Every run is a job of ``python -m stem_megatron.train -m hydra/launcher=submitit_local ...`` (the sweep commands
are in benchmarks/study_arms.py and in the report), on the tiny model (``model=tiny``, one process, one torch
thread) with the same tokens: the python-doc corpus blended with synthetic facts ("The capital of X is Y.",
``stem_megatron.data.facts``). Each run writes metrics.jsonl and an offline W&B run (group ``study-<arm>``).
``benchmarks/study_eval.py`` scores the exports of the main and ablation runs (held-out accuracy, fact recall,
edit success, FLOPs) and ``benchmarks/study_report.py`` writes docs/results.md and its plots.

A run whose ``study.json`` matches its command is not repeated, so an interrupted study continues where it
stopped; ``--fresh`` retrains everything. A stress run that dies of non-finite values is kept as diverged.

Run (after ``bash tools/setup.sh``): ``.venv/bin/python benchmarks/study.py``  (about 3 hours here: see
the report's "How to run").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's stem_megatron, installed or not
from stem_megatron.setup_check import corpus_problem, require_environment, require_extra  # noqa: E402

require_environment()  # before torch and megatron: another Python gets `make setup`, not a traceback
require_extra("slurm", "plots")  # Hydra's submitit launcher runs the sweeps; the report draws

from submitit.core.utils import JobPaths, pickle_load  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))

from study_arms import (LEAN_STATES, LEAN_VARIANTS, SEED, TABLE_STATES, VARIANTS, Arm, arms, chunks,  # noqa: E402
                        sweep_command)
from study_lean import write_lean  # noqa: E402
from study_report import write_report  # noqa: E402

from stem_megatron.data.facts import build_facts  # noqa: E402
from stem_megatron.parallel import child_env  # noqa: E402

DIVERGED = ("non-finite", "FloatingPointError")  # how a run that diverged ends (training/step.py)


def common_overrides(args) -> list[str]:
    """Overrides every run of every arm shares."""
    return ["parallel=single", f"train.eval_iters={args.eval_iters}", f"data.dir={args.data_dir}",
            f"data.blend=[[{100 - args.facts_share},train],[{args.facts_share},'{args.facts_prefix}']]",
            "checkpoint.resume=false", *args.override]


def identity(arm: Arm, point: dict, args) -> dict:
    """What decides a run: its one-point sweep command without the launcher's settings."""
    command = sweep_command(arm, [point], "<dir>", common_overrides(args))
    return {"overrides": [c for c in command[4:] if not c.startswith("hydra")], "facts": str(args.facts_prefix)}


def finished(arm: Arm, point: dict, args) -> bool:
    path = args.out / arm.name / arm.run_name(point) / "study.json"
    return path.is_file() and {k: v for k, v in json.loads(path.read_text()).items()
                               if k in ("overrides", "facts")} == identity(arm, point, args)


def every_lean_run(arm: Arm, args) -> list[str]:
    """The lean arm's finished runs of every variant and table state at its seeds: a command that names fewer
    (``--lean-states``) runs the missing points, and the section weighs them with the earlier ones."""
    every = dataclasses.replace(arm, swept={"variant": LEAN_VARIANTS, "table_state": list(TABLE_STATES),
                                            SEED: arm.swept[SEED]})
    return [every.run_name(p) for p in every.points() if finished(every, p, args)]


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return json.loads(lines[-1])["step"] if lines else 0


def job_errors(folder: Path, timeout_s: float = 600) -> dict[str, str]:
    """``{run dir: traceback}`` of the failed jobs of one sweep (submitit's job files, ``<folder>/<job id>/``),
    after waiting for all its jobs to end (the launcher returns at the first failure while others still run)."""
    jobs = [JobPaths(folder / "%j", job_id=d.name) for d in folder.iterdir() if d.is_dir()]
    jobs = [job for job in jobs if job.submitted_pickle.is_file()]  # not the launcher's own "%j" folder
    deadline = time.time() + timeout_s
    while time.time() < deadline and any(not job.result_pickle.is_file() for job in jobs):
        time.sleep(2)
    errors = {}
    for job in jobs:
        out = job.stdout.read_text(errors="replace") if job.stdout.is_file() else ""
        run = next((line.split(": ", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("run directory: ")), None)
        if run and job.result_pickle.is_file():
            outcome, value = pickle_load(job.result_pickle)
            if outcome == "error":
                errors[str(Path(run).resolve())] = str(value)
    return errors


def score(run_dir: Path, args, env: dict) -> None:
    with open(run_dir / "eval.log", "w") as log:
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "study_eval.py"), str(run_dir),
                               "--facts", str(args.facts_prefix), "--valid-windows", str(args.valid_windows)],
                              cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"scoring {run_dir} failed (exit {proc.returncode}); log {run_dir / 'eval.log'} ends:\n"
                           + (run_dir / "eval.log").read_text()[-3000:])


def run_sweep(arm: Arm, points: list[dict], args, env: dict, number: int) -> None:
    """One sweep of ``points`` side by side; each run is then scored and marked done (or diverged)."""
    arm_dir = (args.out / arm.name).resolve()
    names = [arm.run_name(p) for p in points]
    folder = arm_dir / ".submitit" / f"sweep{number}"
    shutil.rmtree(folder, ignore_errors=True)
    command = sweep_command(arm, points, arm_dir, common_overrides(args))
    command[command.index(f"hydra.launcher.submitit_folder={arm_dir}/.submitit/%j")] = \
        f"hydra.launcher.submitit_folder={folder}/%j"
    print(f"[{arm.name}] {', '.join(names)}: {arm.steps} steps", flush=True)
    (arm_dir / "sweeps").mkdir(parents=True, exist_ok=True)
    log_path = arm_dir / "sweeps" / f"sweep{number}.log"
    start = time.time()
    with open(log_path, "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        ok = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode == 0
    share_s = (time.time() - start) / len(points)  # the machine's time per run: the sweep's runs share it
    errors = {} if ok else job_errors(folder)
    done = []
    for point, name in zip(points, names):
        run_dir = arm_dir / name
        status = {**identity(arm, point, args), "status": "finished", "machine_s": share_s}
        if last_step(run_dir) < arm.steps or (arm.scored and not (run_dir / "export").is_dir()):
            error = errors.get(str(run_dir.resolve()), "")
            if arm.scored or not any(word in error for word in DIVERGED):
                raise RuntimeError(f"[{arm.name}] {name} did not finish; sweep log {log_path}, "
                                   f"job error:\n{error[-3000:] or log_path.read_text()[-3000:]}")
            status.update(status="diverged", error=error.strip().splitlines()[-1], steps_run=last_step(run_dir))
        done.append((run_dir, status))
    if arm.scored:
        with ThreadPoolExecutor(len(done)) as pool:
            for future in [pool.submit(score, run_dir, args, env) for run_dir, _ in done]:
                future.result()
    for run_dir, status in done:
        (run_dir / "study.json").write_text(json.dumps(status, indent=1))
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the export is what the scores read
        print(f"[{arm.name}] {run_dir.relative_to(arm_dir)}: {status['status']}", flush=True)


def run_arm(arm: Arm, args, env: dict) -> None:
    pending = [p for p in arm.points() if args.fresh or not finished(arm, p, args)]
    if len(pending) < len(arm.points()):
        print(f"[{arm.name}] {len(arm.points()) - len(pending)} runs done earlier", flush=True)
    for point in pending:
        shutil.rmtree(args.out / arm.name / arm.run_name(point), ignore_errors=True)
    for number, points in enumerate(chunks(pending, args.jobs)):
        run_sweep(arm, points, args, env, number)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", nargs="+", default=["main", "ablation", "stress"],
                   choices=["main", "ablation", "stress", "lean"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), help="main arm")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="main arm")
    p.add_argument("--ablation-seeds", nargs="+", type=int, default=[1, 2])
    p.add_argument("--stress-seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--lean-seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--lean-variants", nargs="+", default=LEAN_VARIANTS, choices=LEAN_VARIANTS)
    p.add_argument("--lean-states", nargs="+", default=LEAN_STATES, choices=list(TABLE_STATES),
                   help="recipes/table_state settings of the lean arm")
    p.add_argument("--steps", type=int, default=600, help="global batches of 16 x 128 tokens per run")
    p.add_argument("--stress-steps", type=int, default=300, help="steps of a stress run")
    p.add_argument("--stress-lr", type=float, default=3e-2, help="peak lr of the stress arm (recipe: 3e-3)")
    p.add_argument("--eval-iters", type=int, default=4, help="validation global batches per evaluation")
    p.add_argument("--valid-windows", type=int, default=200, help="held-out windows scored on the export")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side (jobs per sweep)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--data-dir", type=Path, default=Path("data_cache/python-doc"))
    p.add_argument("--facts-share", type=int, default=30, help="percent of training samples drawn from the facts")
    # 400 x 60 (the same 240k-token facts corpus as v1's 150 x 160): at 600 steps v1's facts were all recalled by
    # dense and STEM-1/3 alike (1.00), 1000 x 24 by neither (0.07, 0.05; chance 0.05); 400 x 60 gave 0.66 / 0.995
    p.add_argument("--subjects", type=int, default=400)
    p.add_argument("--answers", type=int, default=32)
    p.add_argument("--repeats", type=int, default=60, help="occurrences of each fact in the facts corpus")
    p.add_argument("--facts-dir", type=Path, default=None,
                   help="where the facts corpus is built (default: --data-dir)")
    p.add_argument("--out", type=Path, default=Path("runs/study"))
    p.add_argument("--report", type=Path, default=Path("docs/results.md"))
    p.add_argument("--fresh", action="store_true", help="retrain runs that finished earlier")
    p.add_argument("--override", nargs="*", default=[], help="extra Hydra overrides for every run")
    args = p.parse_args(argv)
    if not 0 < args.facts_share < 100:
        p.error(f"--facts-share {args.facts_share} must be between 1 and 99 (percent)")
    if problem := corpus_problem(args.data_dir):
        p.error(problem)
    name = f"facts-{args.subjects}x{args.answers}x{args.repeats}"
    args.facts_prefix = ((args.facts_dir or args.data_dir) / name).resolve()
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.facts_prefix.with_suffix(".json").exists():
        stats = build_facts(args.data_dir / "tokenizer.json", args.facts_prefix, args.subjects, args.answers,
                            args.repeats)
        print(f"built {args.facts_prefix}: {stats['subjects']} facts, {stats['tokens']:,} tokens", flush=True)
    start = time.time()
    env = child_env(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
                    PYTHONPATH=str(ROOT), HYDRA_FULL_ERROR="1")
    study_arms = arms(args.variants, args.seeds, args.ablation_seeds, args.stress_seeds, args.steps,
                      args.stress_steps, args.stress_lr, args.arms, args.lean_seeds, args.lean_variants,
                      args.lean_states)
    for arm in study_arms:
        run_arm(arm, args, env)
    study = {"arms": {arm.name: {"swept": arm.swept, "fixed": arm.fixed, "steps": arm.steps,
                                 "runs": [arm.run_name(p) for p in arm.points()],
                                 "command": " ".join(["python", *sweep_command(arm, arm.points(), args.out / arm.name,
                                                                               common_overrides(args))[1:]])}
                      for arm in study_arms},
             "variants": args.variants, "seeds": args.seeds, "steps": args.steps, "jobs": args.jobs,
             "threads": args.threads, "facts_share": args.facts_share, "subjects": args.subjects,
             "answers": args.answers, "repeats": args.repeats, "overrides": args.override,
             "stress_lr": args.stress_lr, "wall_s": time.time() - start,
             "command": " ".join(["python", "benchmarks/study.py", *(argv if argv is not None else sys.argv[1:])])}
    lean = study["arms"].pop("lean", None)  # its own settings and section: the main report's stay as they were
    if study["arms"]:
        (args.out / "settings.json").write_text(json.dumps(study, indent=1))
    if "main" in args.arms:
        write_report(args.out, args.report, study)
        print(f"wrote {args.report} ({time.time() - start:.0f} s)", flush=True)
    elif not lean:
        print("no report: it needs the main arm (its setup and the paper's claims)", flush=True)
    if lean:
        lean["runs"] = every_lean_run(next(arm for arm in study_arms if arm.name == "lean"), args)
        lean_study = {**study, "arms": {"lean": lean}, "seeds": args.lean_seeds}
        (args.out / "lean" / "settings.json").write_text(json.dumps(lean_study, indent=1))
        write_lean(args.out, args.report, lean_study)
        print(f"wrote the lean arm's section of {args.report}", flush=True)


if __name__ == "__main__":
    main()
