"""``stem-edit``: swap/copy a word's STEM rows for another's and show the next-token shift (paper Fig. 5).

    stem-edit --export DIR --source " Spain" --target " Germany" --prompt "The capital of Spain is"
              [--layers all|1,3] [--mode swap|copy] [--length-strategy filler|clone|average]
              [--top-k 5] [--plot out.png] [--save-edited DIR] [--save-log edits.json] [--json]

Prints the top-k next-token probabilities of (1) the original prompt, (2) the target prompt (the
prompt with the source word replaced by the target word, or ``--target-prompt``) and (3) the edited
model on the original prompt. Layers are 0-based indices of STEM layers (``decoder.layers.<i>``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from stem_megatron.edit.edits import MODES, StemEditor
from stem_megatron.edit.row_plan import STRATEGIES
from stem_megatron.setup_check import require_extra


@torch.no_grad()
def topk_next(model, prompt_ids: Sequence[int], k: int = 5) -> list[dict]:
    """``[{id, token, prob}]`` of the k most likely next tokens after ``prompt_ids`` (decodable ids only)."""
    ids = list(prompt_ids)[-model.seq_length:]
    logits = model.logits(torch.tensor([ids]))[0, -1, :model.decodable_ids]
    probs = torch.softmax(logits.double(), dim=-1)
    top = torch.topk(probs, min(k, probs.numel()))
    return [{"id": int(i), "token": model.decode([int(i)]) if model.tokenizer is not None else str(int(i)),
             "prob": float(p)} for p, i in zip(top.values, top.indices)]


def contains(seq: Sequence[int], sub: Sequence[int]) -> bool:
    n = len(sub)
    return any(list(seq[i:i + n]) == list(sub) for i in range(len(seq) - n + 1))


def knowledge_edit(model, source: str, target: str, prompt: str, target_prompt: Optional[str] = None,
                   mode: str = "swap", layers="all", strategy: str = "filler", filler: Optional[str] = None,
                   top_k: int = 5, editor: Optional[StemEditor] = None) -> tuple[dict, StemEditor]:
    """Fig. 5 on an ``InferenceModel``: top-k before, on the target prompt, and after the edit.

    The edit stays applied (``editor.undo()`` reverts it). Returns ``(report, editor)``.
    """
    editor = editor or StemEditor.from_model(model)
    src, tgt = model.encode(source), model.encode(target)
    prompt_ids = model.encode(prompt)
    target_prompt = target_prompt if target_prompt is not None else prompt.replace(source, target)
    target_ids = model.encode(target_prompt)
    filler_id = model.eod_id if filler is None else _single_id(model, filler)
    warnings = []
    if not contains(prompt_ids, src):
        warnings.append(f"the source ids {src} do not occur in the prompt's ids {prompt_ids}: the edit cannot change "
                        "the rows this prompt reads")
    report = {"source": {"text": source, "ids": src}, "target": {"text": target, "ids": tgt},
              "prompt": prompt, "target_prompt": target_prompt,
              "original": topk_next(model, prompt_ids, top_k), "target_run": topk_next(model, target_ids, top_k)}
    record = editor.edit_words(src, tgt, mode, layers, strategy, filler_id,
                               meta={"source": source, "target": target, "prompt": prompt})
    report["edited"] = topk_next(model, prompt_ids, top_k)
    report.update(mode=mode, layers=record.layers, length_strategy=strategy, rows_written=record.ids,
                  plan=record.meta["plan"], warnings=warnings)
    report["edited_matches_target_top1"] = report["edited"][0]["id"] == report["target_run"][0]["id"]
    return report, editor


def _single_id(model, text: str) -> int:
    ids = model.encode(text)
    if len(ids) != 1:
        raise ValueError(f"--filler {text!r} is {len(ids)} tokens {ids}; the filler must be exactly one token")
    return ids[0]


def format_report(report: dict) -> str:
    lines = [f"edit: {report['mode']} rows of {report['source']['text']!r} {report['source']['ids']} <- "
             f"{report['target']['text']!r} {report['target']['ids']} at STEM layers {report['layers']} "
             f"(length strategy {report['length_strategy']})"]
    for key, title in (("original", f"original prompt   {report['prompt']!r}"),
                       ("target_run", f"target prompt     {report['target_prompt']!r}"),
                       ("edited", f"edited model on   {report['prompt']!r}")):
        lines.append(title)
        lines += [f"    {r['prob']:.4f}  {r['token']!r} ({r['id']})" for r in report[key]]
    lines += [f"warning: {w}" for w in report["warnings"]]
    return "\n".join(lines)


def plot_report(report: dict, path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5), sharey=True)
    titles = (("original", "original prompt"), ("target_run", "target prompt"), ("edited", "edited model"))
    for ax, (key, title) in zip(axes, titles):
        rows = report[key]
        ax.bar(range(len(rows)), [r["prob"] for r in rows], color="tab:blue" if key != "edited" else "tab:orange")
        ax.set_xticks(range(len(rows)), [repr(r["token"]) for r in rows], rotation=45, ha="right")
        ax.set_title(title)
    axes[0].set_ylabel("next-token probability")
    fig.suptitle(f"{report['source']['text']!r} <- {report['target']['text']!r} ({report['mode']}, "
                 f"layers {report['layers']})")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def save_edited(model, out_dir) -> Path:
    """Write the (edited) model as a new export (same config and tokenizer)."""
    from stem_megatron.export.format import TOKENIZER, write_export

    weights = {n: p.detach().cpu() for n, p in model.model.named_parameters()}
    tokenizer = Path(model.export_dir) / TOKENIZER
    return write_export(out_dir, model.config, weights, tokenizer if tokenizer.is_file() else None)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="stem-edit", description=__doc__.split("\n")[0])
    p.add_argument("--export", required=True, help="export directory (stem-megatron-export-v1)")
    p.add_argument("--source", required=True, help="word whose STEM rows are replaced, e.g. ' Spain'")
    p.add_argument("--target", required=True, help="word whose rows it gets, e.g. ' Germany'")
    p.add_argument("--prompt", required=True)
    p.add_argument("--target-prompt", help="control prompt (default: the prompt with source replaced by target)")
    p.add_argument("--layers", default="all", help="'all' or comma-separated 0-based STEM layer indices")
    p.add_argument("--mode", choices=MODES, default="swap")
    p.add_argument("--length-strategy", choices=STRATEGIES, default="filler")
    p.add_argument("--filler", help="one-token filler word for --length-strategy filler (default: the EOD token)")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--plot", help="bar plot of the three distributions (png)")
    p.add_argument("--save-edited", help="write the edited model as a new export directory")
    p.add_argument("--save-log", help="write the edit log (.json or .pt) for undo/redo elsewhere")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    if args.top_k < 1:
        p.error("--top-k must be >= 1")
    return args


def main(argv=None) -> int:
    """Bad input (an export, words that share tokens, layers, an edit log) is one line naming it, not a
    traceback: the edit and inference code raise ValueError (ExportError) for nothing else. ``--plot`` without
    the `plots` extra (matplotlib) is named before the edit runs."""
    args = parse_args(argv)
    if args.plot:
        require_extra("plots", command="stem-edit")
    try:
        return run(args)
    except ValueError as e:
        raise SystemExit(f"stem-edit: error: {e}") from None


def run(args: argparse.Namespace) -> int:
    from stem_megatron.inference.model import InferenceModel

    model = InferenceModel(args.export, device=args.device)
    report, editor = knowledge_edit(model, args.source, args.target, args.prompt, args.target_prompt, args.mode,
                                    args.layers, args.length_strategy, args.filler, args.top_k)
    if args.plot:
        report["plot"] = str(plot_report(report, args.plot))
    if args.save_log:
        report["log"] = str(editor.save_log(args.save_log))
    if args.save_edited:
        report["edited_export"] = str(save_edited(model, args.save_edited))
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
