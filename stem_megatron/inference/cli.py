"""``stem-generate``: KV-cache generation from a single-process export, with the per-step byte report.

    stem-generate --export runs/x/export --prompt "def f(x):" --prompt "The heap" --max-new-tokens 32
    stem-generate --export E --prompt "..." --temperature 0.8 --top-p 0.9 --seed 7 --cache-rows 4096 --json
    stem-generate --export E --prompt-ids 1,5,9 --max-new-tokens 8 --placement device

The prompts are decoded as one batch. ``--placement host`` (default) keeps the STEM tables in host
memory and moves only the rows of each step's distinct tokens to the device (``--cache-rows K`` keeps
the K most frequent rows there); ``device`` holds them as parameters. The report lists, per forward,
the batch, its distinct tokens (B_uniq), the rows fetched from host memory / the cache, and the
parameter bytes loaded by this STEM model vs a dense model of the same shape (paper Table 1,
decoding rows). ``--json`` prints everything as one JSON object instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Optional, Sequence


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids") from None


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="stem-generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", required=True, help="export directory (config.json, model.pt, tokenizer.json)")
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable: one batch)")
    p.add_argument("--prompt-ids", action="append", type=_ids, default=[],
                   help="a prompt as comma-separated token ids (repeatable; for exports without a tokenizer)")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234, help="seed of the sampling generator")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--placement", choices=("host", "device"), default="host",
                   help="STEM tables in host memory (rows fetched per step) or on the device")
    p.add_argument("--cache-rows", type=int, default=0, help="hot rows per STEM table kept on the device (host)")
    p.add_argument("--refresh-every", type=int, default=50, help="re-choose the cached rows every N forwards")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--json", action="store_true", help="print one JSON object (generations, steps, summary)")
    args = p.parse_args(argv)
    if bool(args.prompt) == bool(args.prompt_ids):
        p.error("give the prompts either as --prompt text or as --prompt-ids, at least one")
    if args.max_new_tokens < 0:
        p.error("--max-new-tokens must be >= 0")
    if args.temperature > 0 and not 0.0 < args.top_p <= 1.0:
        p.error("--top-p must be in (0, 1]")
    if args.cache_rows < 0:
        p.error("--cache-rows must be >= 0")
    if args.cache_rows and args.placement != "host":
        p.error("--cache-rows needs --placement host")
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console entry point (returns None: setuptools' wrapper exits with main's return value). Bad input (an
    export, prompt ids, a length) is one line naming it, not a traceback: the inference code raises ValueError
    (ExportError, DataError) for nothing else."""
    args = parse_args(argv)
    try:
        run(args)
    except ValueError as e:
        raise SystemExit(f"stem-generate: error: {e}") from None


def run(args: argparse.Namespace) -> dict:
    import torch

    from stem_megatron.inference.generate import cut_at_stop, format_report, generate_batch
    from stem_megatron.inference.model import InferenceModel

    model = InferenceModel(args.export, placement=args.placement, cache_rows=args.cache_rows, device=args.device,
                           refresh_every=args.refresh_every)
    prompts = [model.encode(p) for p in args.prompt] if args.prompt else args.prompt_ids
    generator = torch.Generator().manual_seed(args.seed)
    result = generate_batch(model, prompts, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            generator=generator, stop=args.stop)
    generations = []
    for i, ids in enumerate(result.tokens):
        item = {"prompt_ids": list(prompts[i]), "ids": ids}
        if model.tokenizer is not None:
            item.update(prompt=model.decode(prompts[i]), text=cut_at_stop(model.decode(ids), args.stop))
        generations.append(item)
    out = {"export": str(args.export), "generations": generations, "steps": result.steps, "summary": result.summary,
           "budget": dataclasses.asdict(model.budget),
           "settings": {k: getattr(args, k) for k in ("max_new_tokens", "temperature", "top_p", "seed", "placement",
                                                        "cache_rows", "refresh_every", "stop")}}
    if args.json:
        print(json.dumps(out, indent=2))
        return out
    for i, item in enumerate(generations):
        print(f"=== [{i}] " + (repr(item["prompt"]) if "prompt" in item else str(item["prompt_ids"])))
        print(item.get("text", item["ids"]))
    print()
    print(format_report(result, model.budget))
    return out


if __name__ == "__main__":
    main()
