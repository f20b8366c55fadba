"""Dense to STEM conversion study (one command): does a dense model converted to STEM keep what it learned?

Per seed, on the tiny model and the reproduction study's tokens (python-doc blended with synthetic facts):
1. ``base``: a dense model trained ``--steps`` (600) steps, exported (``checkpoint.export``, ``stem-export-hf``);
2. that Hugging Face directory continued ``--more`` steps (``checkpoint.init_from_hf``, a fresh optimizer and
   schedule) as ``dense``, as ``stem-scaled`` (STEM-1/3, the paper's table init) and as ``stem-from_dense``
   (STEM-1/3, ``U_l[t] = W_u E[x_l | t]`` over ``--calibration-tokens`` of the training mix);
3. ``scratch``: STEM-1/3 trained from scratch for ``--steps + --more`` steps, the same total tokens.
Each continuation is also run for one step at learning rate 0 (nothing changes; its validation is the converted
model's: "valid loss after conversion"). Every final model is scored on its export (``study_eval.evaluate``: held-out
loss and accuracy, fact recall), a seed's five in one process. ``docs/results.md`` gets the table between this
script's markers.

Every run is ``python -m stem_megatron.train`` (one process, one torch thread, ``--jobs`` side by side; a seed's
scoring runs beside the other seeds' runs). A run whose
``done.json`` matches its command is not repeated. Run: ``.venv/bin/python benchmarks/conversion_study.py``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's stem_megatron, installed or not
sys.path.insert(0, str(ROOT / "benchmarks"))
from stem_megatron.setup_check import require_environment, require_extra  # noqa: E402

require_environment()
require_extra("hf")  # stem-export-hf and the calibration pass run transformers

from stem_megatron.data.facts import build_facts  # noqa: E402
from stem_megatron.parallel import child_env  # noqa: E402

BEGIN, END = "<!-- conversion-study: begin -->", "<!-- conversion-study: end -->"
ARMS = {"dense": ["variant=dense"], "stem-scaled": ["variant=stem_1_3", "stem.table_init=scaled"],
        "stem-from_dense": ["variant=stem_1_3", "stem.table_init=from_dense"]}


def run(name: str, overrides: list[str], args, env: dict) -> Path:
    """``python -m stem_megatron.train`` with ``overrides`` into ``<out>/<name>`` (skipped when done before)."""
    out = (args.out / name).resolve()
    command = [sys.executable, "-m", "stem_megatron.train", "parallel=single", "model=tiny",
               f"data.dir={args.data_dir}",
               f"data.blend=[[{100 - args.facts_share},train],[{args.facts_share},'{args.facts}']]",
               f"train.eval_iters={args.eval_iters}", "checkpoint.resume=false", "checkpoint.save=false",
               f"out_dir={out}", *overrides]
    done = out / "done.json"
    if done.is_file() and json.loads(done.read_text())["command"] == command[1:]:
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    start = time.time()
    with open(out / "train.log", "w") as log:
        code = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if code:
        raise RuntimeError(f"{name} failed (exit {code}); {out / 'train.log'} ends:\n"
                           + (out / "train.log").read_text()[-3000:])
    done.write_text(json.dumps({"command": command[1:], "wall_s": time.time() - start}))
    print(f"{name}: {time.time() - start:.0f} s", flush=True)
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_valid(run_dir: Path) -> float:
    return [r["valid_loss"] for r in metrics(run_dir) if r.get("valid_loss") is not None][-1]


def score(run_dirs: list[Path], args, env: dict) -> list[dict]:
    """``benchmarks/study_eval.py`` on the runs' exports not scored yet, in one process of its own (it starts a
    megatron state; torch and megatron are imported once for all of them)."""
    todo = [str(run_dir) for run_dir in run_dirs if not (run_dir / "eval.json").is_file()]
    if todo:
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "study_eval.py"), *todo, "--facts",
                        str(args.facts), "--valid-windows", str(args.valid_windows), "--edit-pairs", "0"],
                       cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return [json.loads((run_dir / "eval.json").read_text()) for run_dir in run_dirs]


def seed_runs(seed: int, args, env: dict, pool: ThreadPoolExecutor) -> dict:
    """The runs of one seed; returns ``{arm: {after_conversion, valid, recall, accuracy, flops}}``."""
    base = [f"train.seed={seed}", f"train.eval_interval={max(1, args.steps // 10)}"]
    tag = f"seed{seed}"

    def export(name: str) -> str:
        return f"checkpoint.export={(args.out / tag / name / 'export').resolve()}"

    scratch = pool.submit(run, f"{tag}/scratch", [*base, "variant=stem_1_3", f"train.steps={args.steps + args.more}",
                                                  export("scratch")], args, env)
    dense = pool.submit(run, f"{tag}/base", [*base, "variant=dense", f"train.steps={args.steps}", export("base")],
                        args, env).result()
    hf = dense / "hf"
    if not hf.is_dir():
        subprocess.run([sys.executable, "-m", "stem_megatron.export.hf.cli", str(dense / "export"), str(hf)],
                       cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    start = [f"checkpoint.init_from_hf={hf}", f"stem.calibration_tokens={args.calibration_tokens}"]
    jobs = {}
    for arm, variant in ARMS.items():
        jobs[arm, "zero"] = pool.submit(run, f"{tag}/{arm}-at-conversion", [*base, *variant, *start, "train.steps=1",
                                                                             "train.lr=0"], args, env)
        jobs[arm, "more"] = pool.submit(run, f"{tag}/{arm}", [*base, *variant, *start, f"train.steps={args.more}",
                                                             export(arm)], args, env)
    runs = {"base": dense, **{arm: jobs[arm, "more"].result() for arm in ARMS}, "scratch": scratch.result()}
    finals = dict(zip(runs, score(list(runs.values()), args, env)))
    dense_eval = finals["base"]
    out = {}
    for arm in ARMS:
        final = finals[arm]
        out[arm] = {"after_conversion": final_valid(jobs[arm, "zero"].result()),
                    "valid": final_valid(args.out / tag / arm),
                    "heldout": final["valid_nll"], "accuracy": final["valid_accuracy"], "recall": final["fact_recall"],
                    "flops": dense_eval["train_flops"] + final["train_flops"]}
    final = finals["scratch"]
    out["scratch"] = {"after_conversion": None, "valid": final_valid(args.out / tag / "scratch"),
                      "heldout": final["valid_nll"], "accuracy": final["valid_accuracy"],
                      "recall": final["fact_recall"], "flops": final["train_flops"]}
    out["base"] = {"after_conversion": None, "valid": final_valid(dense), "heldout": dense_eval["valid_nll"],
                        "accuracy": dense_eval["valid_accuracy"], "recall": dense_eval["fact_recall"],
                        "flops": dense_eval["train_flops"]}
    return out


def spread(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    return f"{statistics.mean(values):.4f} [{min(values):.4f}, {max(values):.4f}]"


def percent(values) -> str:
    return f"{100 * statistics.mean(values):.1f}% [{100 * min(values):.1f}%, {100 * max(values):.1f}%]"


def report(results: dict, args, wall_s: float) -> str:
    rows = {"base": f"dense, {args.steps} steps (the model converted)",
            "dense": f"dense, + {args.more} steps", "stem-scaled": f"STEM-1/3 paper init, + {args.more} steps",
            "stem-from_dense": f"STEM-1/3 from_dense, + {args.more} steps",
            "scratch": f"STEM-1/3 from scratch, {args.steps + args.more} steps"}
    seeds = sorted(results)
    lines = [BEGIN, "## Dense to STEM conversion",
             f"*Generated by `python benchmarks/conversion_study.py` ({wall_s / 60:.0f} min); rerun it to refresh.*",
             "",
             f"A dense `tiny` model trained {args.steps} steps is exported to Hugging Face (`stem-export-hf`) and "
             "imported with `checkpoint.init_from_hf` as dense, as STEM-1/3 with the paper's table init (`scaled`) "
             f"and as STEM-1/3 `from_dense` (`U_l[t] = W_u E[x_l | t]`, {args.calibration_tokens:,} calibration "
             f"tokens of the training mix), each continued {args.more} steps with a fresh optimizer and the "
             f"recipe's schedule; against STEM-1/3 trained from scratch for the same {args.steps + args.more} "
             f"steps. The study's data: python-doc with {args.facts_share}% synthetic facts, 16 x 128 tokens a "
             f"step, seeds {seeds}. *After conversion*: the validation loss of the imported model before any "
             "update (one step at lr 0). "
             "Figures: mean [min, max] over the seeds.", "",
             "| model | valid loss after conversion | valid loss (end) | held-out loss | held-out acc | fact recall "
             "| train FLOPs |", "|---|---|---|---|---|---|---|"]
    for key, label in rows.items():
        got = [results[s][key] for s in seeds]
        flops = statistics.mean(g["flops"] for g in got) / 1e12
        lines.append(f"| {label} | {spread(g['after_conversion'] for g in got)} | {spread(g['valid'] for g in got)} | "
                     f"{spread(g['heldout'] for g in got)} | {percent([g['accuracy'] for g in got])} | "
                     f"{percent([g['recall'] for g in got])} | {flops:.2f}T |")
    lines += ["", f"Train FLOPs of a continuation include the dense model's {args.steps} steps. "
              "`from_dense` is ours, not the paper's (docs/checkpoints.md, \"Hugging Face import\").", END]
    return "\n".join(lines)


def write_section(path: Path, section: str) -> None:
    """``section`` in place of the one between the markers in ``path`` (appended when there is none)."""
    text = path.read_text()
    if BEGIN in text:
        text = text[:text.index(BEGIN)] + section + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=600, help="steps of the dense model converted")
    p.add_argument("--more", type=int, default=300, help="steps of each continuation")
    p.add_argument("--calibration-tokens", type=int, default=327_680, help="from_dense's pass (2,560 windows)")
    p.add_argument("--eval-iters", type=int, default=4)
    p.add_argument("--valid-windows", type=int, default=200)
    p.add_argument("--facts-share", type=int, default=30)
    # the reproduction study's facts (benchmarks/study.py): 400 subjects, 32 answers, each fact 60 times
    p.add_argument("--subjects", type=int, default=400)
    p.add_argument("--answers", type=int, default=32)
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--facts-dir", type=Path, default=None, help="where the facts corpus is (default: --data-dir)")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side")
    p.add_argument("--data-dir", type=Path, default=Path("data_cache/python-doc"))
    p.add_argument("--out", type=Path, default=Path("runs/conversion_study"))
    p.add_argument("--report", type=Path, default=Path("docs/results.md"))
    args = p.parse_args(argv)
    args.data_dir = args.data_dir.resolve()
    args.facts = (args.facts_dir or args.data_dir).resolve() / f"facts-{args.subjects}x{args.answers}x{args.repeats}"
    if not args.facts.with_suffix(".json").is_file():
        build_facts(args.data_dir / "tokenizer.json", args.facts, args.subjects, args.answers, args.repeats)
    env = child_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT), HYDRA_FULL_ERROR="1")
    start = time.time()
    with ThreadPoolExecutor(args.jobs) as pool, ThreadPoolExecutor(len(args.seeds)) as seeds:
        # the seeds side by side, their runs through one pool of --jobs processes
        futures = {seed: seeds.submit(seed_runs, seed, args, env, pool) for seed in args.seeds}
        results = {seed: future.result() for seed, future in futures.items()}
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    write_section(args.report, report(results, args, time.time() - start))
    print(f"wrote {args.report} ({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
