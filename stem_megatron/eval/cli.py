"""``stem-eval``: evaluate a single-process export with lm-eval tasks, Needle-in-a-Haystack and perplexity.

    stem-eval --export runs/x/export --tasks paper --out results.json            # the paper's suite (HF hub)
    stem-eval --export E --task-file tests/data/mc_task.yaml --limit 8 --out r.json  # a local task, offline
    stem-eval --export E --niah --lengths 256,512 --depths 0,0.5,1 --haystack data_cache/python-doc/valid \\
              --ppl --data data_cache/python-doc/valid --out r.json

``--tasks paper`` is ARC-E/C, BoolQ, PIQA, SIQA, HellaSwag, OBQA, WinoGrande, GSM8K, MMLU (lm-eval's
arc_easy, arc_challenge, boolq, piqa, social_iqa, hellaswag, openbookqa, winogrande, gsm8k, mmlu).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Optional, Sequence

from stem_megatron.setup_check import require_extra

# the paper's suite by lm-eval task name (here, not in eval/tasks.py: that imports lm-eval, the `eval` extra)
PAPER_SUITE = {
    "ARC-E": "arc_easy",
    "ARC-C": "arc_challenge",
    "BoolQ": "boolq",
    "PIQA": "piqa",
    "SIQA": "social_iqa",
    "HellaSwag": "hellaswag",
    "OBQA": "openbookqa",
    "WinoGrande": "winogrande",
    "GSM8K": "gsm8k",
    "MMLU": "mmlu",
}


def _csv(cast):
    return lambda text: [cast(x) for x in text.split(",") if x.strip()]


def _limit(text: str) -> float:
    value = float(text)
    return int(value) if value >= 1 and value.is_integer() else value


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="stem-eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", required=True, help="export directory (config.json, model.pt, tokenizer.json)")
    p.add_argument("--out", required=True, help="results JSON file")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    g = p.add_argument_group("lm-eval-harness tasks")
    g.add_argument("--tasks", type=_csv(str), default=[],
                   help="lm-eval task names, comma separated; 'paper' = the paper's suite")
    g.add_argument("--task-file", action="append", default=[], help="a local lm-eval task YAML (repeatable)")
    g.add_argument("--include-path", default=None, help="directory of task YAMLs; without --tasks, all its tasks run")
    g.add_argument("--limit", type=_limit, default=None, help="examples per task (a fraction if < 1)")
    g.add_argument("--num-fewshot", type=int, default=None)
    g = p.add_argument_group("Needle in a Haystack")
    g.add_argument("--niah", action="store_true")
    g.add_argument("--lengths", type=_csv(int), default=[256, 512], help="context lengths in tokens")
    g.add_argument("--depths", type=_csv(float), default=[0.0, 0.25, 0.5, 0.75, 1.0], help="needle depths in [0, 1]")
    g.add_argument("--niah-samples", type=int, default=1, help="cases per (length, depth)")
    g.add_argument("--haystack", default=None, help="text file or indexed dataset prefix (default: --data)")
    g.add_argument("--max-new-tokens", type=int, default=8)
    g.add_argument("--niah-plot", default=None, help="write the accuracy heat map to this PNG")
    g = p.add_argument_group("held-out perplexity")
    g.add_argument("--ppl", action="store_true")
    g.add_argument("--data", default=None, help="indexed dataset prefix (<prefix>.bin/.idx), e.g. DIR/valid")
    g.add_argument("--ppl-max-windows", type=int, default=None, help="score at most this many windows")
    args = p.parse_args(argv)
    if not (args.tasks or args.task_file or args.include_path or args.niah or args.ppl):
        p.error("nothing to evaluate: give --tasks/--task-file/--include-path, --niah and/or --ppl")
    if args.ppl and args.data is None:
        p.error("--ppl needs --data <indexed dataset prefix>")
    if args.niah and (args.haystack or args.data) is None:
        p.error("--niah needs --haystack <text file or indexed prefix> (or --data)")
    args.tasks = [t for name in args.tasks for t in (PAPER_SUITE.values() if name == "paper" else [name])]
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console entry point (returns None: setuptools' wrapper exits with main's return value). Bad input (an
    export, a dataset, a task file, a length) is one line naming it and the fix, not a traceback: the evaluation
    code raises ValueError (ExportError, DataError) or FileNotFoundError for nothing else. A missing extra (lm-eval
    for tasks, matplotlib for the NIAH figure) is named before anything runs."""
    args = parse_args(argv)
    needs = {"eval": args.tasks or args.task_file or args.include_path, "plots": args.niah and args.niah_plot}
    require_extra(*(extra for extra, wanted in needs.items() if wanted), command="stem-eval")
    try:
        evaluate(args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"stem-eval: error: {e}") from None


def evaluate(args: argparse.Namespace) -> dict:
    """Runs what ``args`` asks for, writes ``args.out`` and returns the results."""
    from stem_megatron.inference.model import InferenceModel

    model = InferenceModel(args.export, device=args.device)
    results: dict = {"export": str(Path(args.export).resolve()), "config": dataclasses.asdict(model.config)}
    if args.tasks or args.task_file or args.include_path:
        from stem_megatron.eval.lm_adapter import STEMLM
        from stem_megatron.eval.tasks import run_tasks, summary

        lm = STEMLM(model=model, batch_size=args.batch_size, seed=args.seed)
        out = run_tasks(lm, args.tasks, args.task_file, args.include_path, args.limit, args.num_fewshot, seed=args.seed)
        results["lm_eval"] = summary(out)
    if args.niah:
        from stem_megatron.eval.niah import haystack_ids, plot_heatmap, run_niah

        hay = haystack_ids(args.haystack or args.data, model.require_tokenizer())
        results["niah"] = run_niah(model, hay, args.lengths, args.depths, args.niah_samples,
                                   args.max_new_tokens, args.seed)
        if args.niah_plot:
            plot_heatmap(results["niah"], args.niah_plot)
    if args.ppl:
        from stem_megatron.eval.perplexity import held_out_perplexity

        results["perplexity"] = held_out_perplexity(model, args.data, args.batch_size, args.ppl_max_windows)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, out_path)
    _print_summary(results, out_path)
    return results


def _print_summary(results: dict, path: Path) -> None:
    for task, metrics in results.get("lm_eval", {}).get("results", {}).items():
        shown = {k: v for k, v in metrics.items() if isinstance(v, float) and "stderr" not in k}
        print(f"{task}: " + ", ".join(f"{k}={v:.4f}" for k, v in shown.items()))
    if "niah" in results:
        print(f"niah: mean accuracy {results['niah']['mean_accuracy']:.3f} over lengths {results['niah']['lengths']} "
              f"x depths {results['niah']['depths']}")
    if "perplexity" in results:
        ppl = results["perplexity"]
        print(f"perplexity on {ppl['data']}: {ppl['ppl']:.3f} ({ppl['tokens']} tokens)")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
