"""Small-scale reproduction study: dense vs STEM variants vs Hash-MoE at equal tokens (one command).

Every variant trains the same tiny model (``model=tiny``) on the same tokens with the same seeds: the
real python-doc corpus blended with synthetic facts ("The capital of X is Y.",
``stem_megatron.data.facts``), one process per run, ``--jobs`` runs side by side (one core each, so
wall times are comparable across variants of one study, not with other machines). Each run trains
through ``python -m stem_megatron.train`` (validation loss every ``steps/10`` steps, the loss-spike
detector, an export at the end), then ``benchmarks/study_eval.py`` scores its export (held-out
accuracy, fact recall, edit success, parameters, FLOPs), and ``benchmarks/study_report.py`` writes
docs/results.md and its plots from everything the runs wrote.

A run whose ``eval.json`` exists for the same settings is not repeated, so an interrupted study
continues where it stopped; ``--fresh`` retrains everything.

Run (after ``bash tools/setup.sh``): ``.venv/bin/python benchmarks/study.py``  (about an hour here).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from study_report import VARIANTS, write_report  # noqa: E402

from stem_megatron.data.facts import build_facts  # noqa: E402
from stem_megatron.parallel import child_env  # noqa: E402


def train_command(variant: str, seed: int, args, run_dir: Path) -> list[str]:
    """The training job of one run: Hydra overrides of the default recipe, one process, no TP."""
    return [
        sys.executable, "-m", "stem_megatron.train", "parallel=single", f"variant={variant}", f"out_dir={run_dir}",
        f"train.seed={seed}", f"train.steps={args.steps}", f"train.eval_interval={max(1, args.steps // 10)}",
        f"train.eval_iters={args.eval_iters}", f"data.dir={args.data_dir}",
        f"data.blend=[[{100 - args.facts_share},train],[{args.facts_share},'{args.facts_prefix}']]",
        "checkpoint.resume=false", f"checkpoint.dir={run_dir / 'checkpoints'}",
        f"checkpoint.export={run_dir / 'export'}",
        *args.override,
    ]


def run_one(variant: str, seed: int, args) -> dict:
    """Train and score one (variant, seed) unless an identical run already finished; returns its eval."""
    run_dir = args.out / variant / f"seed{seed}"
    command = train_command(variant, seed, args, run_dir)
    identity = {"command": command[1:], "facts": str(args.facts_prefix)}
    done = run_dir / "eval.json"
    if not args.fresh and done.exists() and (run_dir / "study.json").exists() and \
            json.loads((run_dir / "study.json").read_text()) == identity:
        print(f"[{variant} seed {seed}] done earlier: {done}", flush=True)
        return json.loads(done.read_text())
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    env = child_env(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    start = time.time()
    print(f"[{variant} seed {seed}] training {args.steps} steps -> {run_dir}", flush=True)
    for name, cmd in (("train", command), ("eval", [sys.executable, str(ROOT / "benchmarks" / "study_eval.py"),
                                                      str(run_dir), "--facts", str(args.facts_prefix),
                                                      "--valid-windows", str(args.valid_windows)])):
        with open(run_dir / f"{name}.log", "w") as log:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            tail = (run_dir / f"{name}.log").read_text()[-3000:]
            raise RuntimeError(f"[{variant} seed {seed}] {name} failed (exit {proc.returncode}); "
                               f"log {run_dir / f'{name}.log'} ends:\n{tail}")
    (run_dir / "study.json").write_text(json.dumps(identity, indent=1))
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the export is what the report reads
    result = json.loads(done.read_text())
    print(f"[{variant} seed {seed}] {time.time() - start:.0f} s: valid_nll {result['valid_nll']:.4f} "
          f"fact_recall {result['fact_recall']:.3f}", flush=True)
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    p.add_argument("--steps", type=int, default=400, help="global batches of 16 x 128 tokens per run")
    p.add_argument("--eval-iters", type=int, default=4, help="validation global batches per evaluation")
    p.add_argument("--valid-windows", type=int, default=200, help="held-out windows scored on the export")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--data-dir", type=Path, default=Path("data_cache/python-doc"))
    p.add_argument("--facts-share", type=int, default=30, help="percent of training samples drawn from the facts")
    p.add_argument("--subjects", type=int, default=150)
    p.add_argument("--answers", type=int, default=32)
    p.add_argument("--repeats", type=int, default=160, help="occurrences of each fact in the facts corpus")
    p.add_argument("--facts-dir", type=Path, default=None,
                   help="where the facts corpus is built (default: --data-dir)")
    p.add_argument("--out", type=Path, default=Path("runs/study"))
    p.add_argument("--report", type=Path, default=Path("docs/results.md"))
    p.add_argument("--fresh", action="store_true", help="retrain runs that finished earlier")
    p.add_argument("--override", nargs="*", default=[], help="extra Hydra overrides for every run")
    args = p.parse_args(argv)
    if not 0 < args.facts_share < 100:
        p.error(f"--facts-share {args.facts_share} must be between 1 and 99 (percent)")
    if not (args.data_dir / "tokenizer.json").is_file():
        p.error(f"{args.data_dir}/tokenizer.json is missing: run `bash tools/setup.sh` first (it builds the corpus)")
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
    runs = [(v, s) for s in args.seeds for v in args.variants]
    with ThreadPoolExecutor(args.jobs) as pool:
        for future in [pool.submit(run_one, v, s, args) for v, s in runs]:
            future.result()
    study = {"variants": args.variants, "seeds": args.seeds, "steps": args.steps, "jobs": args.jobs,
             "threads": args.threads, "facts_share": args.facts_share, "subjects": args.subjects,
             "answers": args.answers, "repeats": args.repeats, "overrides": args.override,
             "wall_s": time.time() - start,
             "command": " ".join(["python", "benchmarks/study.py", *(argv if argv is not None else sys.argv[1:])])}
    (args.out / "settings.json").write_text(json.dumps(study, indent=1))
    write_report(args.out, args.report, study)
    print(f"wrote {args.report} ({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
