"""``stem-export-hf EXPORT OUT``: a stem-megatron export (``checkpoint.export=DIR`` of a run, any layout) as a
Hugging Face directory that ``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)`` loads
(``export.hf.writer``; docs/checkpoints.md, "Hugging Face export")."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from stem_megatron.setup_check import require_extra


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="stem-export-hf", description=__doc__.split("\n\n")[0])
    parser.add_argument("export", help="the stem-megatron export directory (config.json, model.pt, tokenizer.json)")
    parser.add_argument("out", help="the Hugging Face directory to write (must not exist)")
    parser.add_argument("--shard-gb", type=float, default=2.0,
                        help="largest safetensors shard of the dense weights, GiB (each STEM table has its own)")
    args = parser.parse_args(argv)
    if args.shard_gb <= 0:
        parser.error(f"--shard-gb {args.shard_gb} must be > 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Bad input (a missing or damaged export, a Hash-MoE model, an existing OUT) is one line, not a traceback."""
    args = parse_args(argv)
    require_extra("hf", command="stem-export-hf")
    from stem_megatron.export.hf.writer import export_hf

    try:
        out = export_hf(args.export, args.out, int(args.shard_gb * 2**30))
    except ValueError as e:  # ExportError
        raise SystemExit(f"stem-export-hf: error: {e}") from None
    print(f"wrote {out}: load it with AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)")


if __name__ == "__main__":
    main()
