"""Test-time capacity scaling (paper §3.2): distinct STEM parameters a context activates vs its length.

    .venv/bin/python tools/capacity_scaling.py --data data_cache/python-doc/valid --export EXPORT_DIR \
        --lengths 64,128,256,512,1024,2048,4096 --out-dir runs/capacity

For each context length L the token stream of the indexed dataset (documents concatenated, as the
training data is packed) is cut into consecutive L-token windows; ``L_uniq`` is the number of distinct
ids in a window, averaged over the windows. The STEM parameters a window activates are
``|S| * d_ff * L_uniq`` (|S| STEM layers; paper eq. in §3.2). |S| and d_ff come from ``--export``'s
config.json or ``--stem-layers/--d-ff``. Every length reads the same token span (the first
``floor(n / L_max) * L_max`` tokens), so the windows of L tile those of any multiple of L and the mean
``L_uniq`` never decreases from L to a multiple of it (distinct(AB) >= mean(distinct(A), distinct(B))).
Writes ``capacity_scaling.json`` (per L: windows, mean/std/min/max L_uniq, activated parameters, the
fraction of the table rows touched) with a Heaps-law fit ``L_uniq ~ k L^beta``, and
``capacity_scaling.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's stem_megatron, installed or not
from stem_megatron.setup_check import require_environment, require_extra  # noqa: E402

require_environment()  # before torch and megatron: another Python gets `make setup`, not a traceback
require_extra("plots")  # every run ends in its figure: say so before the work

import numpy as np  # noqa: E402

DEFAULT_LENGTHS = "64,128,256,512,1024,2048,4096"


def read_tokens(prefix, max_tokens: int) -> np.ndarray:
    """The first ``max_tokens`` tokens of an indexed dataset, documents concatenated."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for suffix in (".idx", ".bin"):
        if not Path(f"{prefix}{suffix}").is_file():
            raise FileNotFoundError(f"{prefix}{suffix} not found: --data takes an indexed dataset prefix "
                                    "(e.g. data_cache/python-doc/valid)")
    dataset = IndexedDataset(str(prefix), mmap=True)
    parts, n = [], 0
    for i in range(len(dataset)):
        doc = np.asarray(dataset[i], dtype=np.int64)
        parts.append(doc[:max_tokens - n])
        n += len(parts[-1])
        if n >= max_tokens:
            break
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def distinct_per_window(tokens: np.ndarray, length: int) -> np.ndarray:
    windows = tokens[:len(tokens) // length * length].reshape(-1, length)
    s = np.sort(windows, axis=1)
    return 1 + (np.diff(s, axis=1) != 0).sum(axis=1)


def capacity_scaling(tokens: np.ndarray, lengths: Sequence[int], d_ff: int, stem_layers: int,
                     vocab_size: Optional[int] = None) -> dict:
    lengths = sorted({int(x) for x in lengths})
    usable = [L for L in lengths if L <= len(tokens)]
    if not usable:
        raise ValueError(f"the corpus has {len(tokens)} tokens, fewer than the shortest length {lengths[0]}")
    span = tokens[:len(tokens) // usable[-1] * usable[-1]]
    rows = []
    for L in usable:
        u = distinct_per_window(span, L)
        mean = float(u.mean())
        row = {"context_length": L, "windows": int(len(u)), "mean_unique": mean, "std_unique": float(u.std()),
               "min_unique": int(u.min()), "max_unique": int(u.max()), "unique_fraction": mean / L,
               "activated_stem_params": mean * d_ff * stem_layers,
               "activated_stem_params_per_token": mean * d_ff * stem_layers / L}
        if vocab_size:
            row["table_rows_touched_fraction"] = mean / vocab_size
        rows.append(row)
    x = np.log([r["context_length"] for r in rows])
    y = np.log([r["mean_unique"] for r in rows])
    beta, logk = (np.polyfit(x, y, 1) if len(rows) > 1 else (float("nan"), float("nan")))
    return {"tokens_read": int(len(tokens)), "tokens_used": int(len(span)), "d_ff": d_ff,
            "stem_layers": stem_layers, "vocab_size": vocab_size, "lengths": rows,
            "skipped_lengths": [L for L in lengths if L > len(tokens)],
            "heaps_fit": {"beta": float(beta), "k": float(np.exp(logk))}}


def plot(result: dict, path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = [r["context_length"] for r in result["lengths"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.errorbar(L, [r["mean_unique"] for r in result["lengths"]], yerr=[r["std_unique"] for r in result["lengths"]],
               marker="o", capsize=3, label="mean distinct tokens")
    a.plot(L, L, "k:", label="L (all distinct)")
    a.set(xscale="log", yscale="log", xlabel="context length L", ylabel="L_uniq",
          title=f"distinct tokens (Heaps beta={result['heaps_fit']['beta']:.2f})")
    a.legend()
    b.plot(L, [r["activated_stem_params"] for r in result["lengths"]], marker="o", color="tab:orange")
    b.set(xscale="log", yscale="log", xlabel="context length L", ylabel="activated STEM parameters",
          title=f"|S| d_ff L_uniq  (|S|={result['stem_layers']}, d_ff={result['d_ff']})")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def model_dims(export) -> tuple[int, int, int]:
    """``(d_ff, number of STEM layers, vocab_size)`` from an export's config.json (no weights read)."""
    from stem_megatron.config import to_run_config
    from stem_megatron.config_moves import upgrade_saved_config
    from stem_megatron.export.format import CONFIG
    from stem_megatron.layer_plan import stem_layer_indices

    cfg = to_run_config(upgrade_saved_config(json.loads((Path(export) / CONFIG).read_text())))
    if cfg.stem.variant not in ("stem", "stem_dagger", "stem_gate"):
        raise ValueError(f"export {export} is variant {cfg.stem.variant!r}: it has no STEM tables")
    layers = stem_layer_indices(cfg.model.num_layers, cfg.stem.ratio, cfg.stem.layers)
    return cfg.model.ffn_hidden_size, len(layers), cfg.model.vocab_size


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="indexed dataset prefix (PREFIX.bin/.idx)")
    p.add_argument("--export", help="export directory: d_ff, STEM layer count and vocab from its config")
    p.add_argument("--d-ff", type=int)
    p.add_argument("--stem-layers", type=int)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--lengths", default=DEFAULT_LENGTHS)
    p.add_argument("--max-tokens", type=int, default=1 << 21)
    p.add_argument("--out-dir", default=".")
    args = p.parse_args(argv)
    if args.export:
        d_ff, stem_layers, vocab = model_dims(args.export)
    elif args.d_ff and args.stem_layers:
        d_ff, stem_layers, vocab = args.d_ff, args.stem_layers, args.vocab_size
    else:
        p.error("give --export or both --d-ff and --stem-layers")
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    if not lengths or min(lengths) < 1:
        p.error("--lengths must be positive integers")
    result = capacity_scaling(read_tokens(args.data, args.max_tokens), lengths, d_ff, stem_layers, vocab)
    result["data"] = str(args.data)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result["plot"] = str(plot(result, out / "capacity_scaling.png"))
    (out / "capacity_scaling.json").write_text(json.dumps(result, indent=2))
    for r in result["lengths"]:
        print(f"L={r['context_length']:6d}  windows={r['windows']:6d}  L_uniq={r['mean_unique']:9.1f}  "
              f"activated STEM params={r['activated_stem_params']:.3e}")
    print(f"Heaps fit: L_uniq ~ {result['heaps_fit']['k']:.2f} L^{result['heaps_fit']['beta']:.3f}; "
          f"wrote {out / 'capacity_scaling.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
