"""One STEM FFN against megatron's dense FFN at the paper's 350M and 1B shapes, forward + backward.

Three modules, timed round-robin on the same input (medians over rounds, ratios to dense):
- ``dense``: megatron-core's MLP from its local layer spec (on GPU its fused SwiGLU, ``bias_activation_fusion``);
- ``stem, gather``: the STEM MLP with the rows expanded per token, the baseline: the micro-batch's fp32 compact rows
  gathered to tokens (``F.embedding``), cast, then ``SiLU(W_g x) ⊙ rows`` (autograd);
- ``stem``: the STEM MLP on the same rows through ``model.stem_rows.silu_times_rows`` (one function: gather in the
  compute dtype inside the product, segmented row-gradient sum over the prefetcher's order).

Each round is a micro-batch of its own, its ids drawn from the 128k-vocabulary profile at the recipe's vocabulary
as ``gpu_step.py`` draws them, so its distinct ids ``u`` (the rows: the fp32 leaf the store registers, its gradient
included) change from call to call as in training, and the compiled function is timed with the dynamic row count
training runs, not a kernel specialized to one ``u``. Goal on GPU: ``stem`` <= 0.75x dense (the matmul
FLOP ideal is 2/3).
On CPU (no fused kernels) the figures show the host's arithmetic only; use ``--tokens`` to shorten.

Run: ``.venv/bin/python benchmarks/stem_layer.py [--models 350M,1B] [--tokens N] [--rounds 7] [--json [FILE]]``.
"""

from __future__ import annotations  # noqa: I001 - stem_megatron (its warning filters) before megatron

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's stem_megatron, installed or not
from stem_megatron.setup_check import require_environment  # noqa: E402

require_environment()  # before torch and megatron: another Python gets `make setup`, not a traceback

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402

from benchmarks.row_sync import DEFAULT_COUNTS, load_counts  # noqa: E402
from stem_megatron import parallel  # noqa: E402
from stem_megatron.config import ModelConfig, ParallelConfig  # noqa: E402
from stem_megatron.flops.distinct import expected_distinct_ids, profile_ids  # noqa: E402
from stem_megatron.model.gpt import transformer_config  # noqa: E402
from stem_megatron.model.specs import stem_mlp_spec  # noqa: E402
from stem_megatron.model.stem_rows import RowOrder  # noqa: E402
from stem_megatron.model.token_context import token_ids  # noqa: E402

# (d, d_ff, heads, micro-batch tokens, vocabulary) of the recipes' models as benchmarks/gpu_step.py runs them
# (seq 2048)
SHAPES = {"350M": (960, 2560, 15, 8192, 32_000), "1B": (2048, 8192, 32, 4096, 128_256)}


class _GatheredRows(MegatronModule):
    """The baseline row source's forward: the compact fp32 rows expanded to tokens, then cast."""

    def load(self, rows: torch.Tensor, index: torch.Tensor) -> None:
        """The micro-batch's rows (``[u, cols]`` fp32) and each token's row (``[s, b]``), as a fetch lands them."""
        self.rows, self.index = rows, index

    def forward(self, _tokens):
        leaf = self.rows.detach().requires_grad_()
        return F.embedding(self.index, leaf).to(self.config.params_dtype)


class _CompactRows(_GatheredRows):
    """A host row source as the store runs it: the compact rows, each token's row and their order, for
    ``silu_times_rows``."""

    def load(self, rows, index):
        super().load(rows, index)
        self.order = RowOrder(*(t.to(rows.device) for t in RowOrder.of(index.cpu(), rows.shape[0])))

    def compact(self, _tokens):
        return self.rows.detach().requires_grad_(), self.index, self.order


def _modules(name: str, tokens: int, device: torch.device) -> tuple[dict, torch.Tensor]:
    """The three FFNs (the STEM ones without rows until ``_load``) and their input ``x`` ``[tokens, 1, d]``."""
    d, d_ff, heads, _, vocab = SHAPES[name]
    model = ModelConfig(name=name, num_layers=1, hidden_size=d, ffn_hidden_size=d_ff, num_attention_heads=heads,
                        vocab_size=vocab, seq_length=tokens)
    config = transformer_config(model, ParallelConfig(), on_gpu=device.type == "cuda")
    dense = get_gpt_layer_local_spec(normalization="RMSNorm").submodules.mlp(
        config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"]),
        is_mtp_layer=False, ffn_hidden_size=d_ff)
    mods = {"dense": dense}
    for label, source in (("stem, gather", _GatheredRows), ("stem", _CompactRows)):
        mlp = build_module(stem_mlp_spec("stem", model.vocab_size), config=config)
        mlp.U_l = source(config=config)
        mods[label] = mlp
    x = torch.randn(tokens, 1, d, device=device, dtype=config.params_dtype)
    return {k: m.to(device) for k, m in mods.items()}, x


def _load(mods: dict, ids: np.ndarray, d_ff: int, device: torch.device) -> tuple[int, torch.Tensor]:
    """A micro-batch of ``ids`` into both STEM FFNs: its distinct ids (``u``) and the tokens ``[1, s]``."""
    uniq, inverse = np.unique(ids, return_inverse=True)
    index = torch.from_numpy(inverse).view(-1, 1).to(device)  # [s, b = 1]
    rows = torch.randn(len(uniq), d_ff, device=device) * 0.02
    for k in ("stem, gather", "stem"):
        mods[k].U_l.load(rows, index)
    return len(uniq), torch.from_numpy(ids).view(1, -1)


def _time(mlp, x, tokens, vocab, device) -> float:
    x = x.detach().requires_grad_()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with token_ids(tokens, vocab):
        out = mlp(x)[0]
    out.backward(torch.ones_like(out))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="350M,1B")
    ap.add_argument("--tokens", type=int, default=None, help="tokens of the micro-batch (default: the model's)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--counts", type=Path, default=DEFAULT_COUNTS)
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                    help="the results as JSON, printed (no FILE) or written to FILE")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    counts = load_counts(args.counts)
    rng = np.random.default_rng(0)
    parallel.single_process_env()
    parallel.initialize(tp=1, pp=1, seed=0)
    results = []
    try:
        for name in args.models.split(","):
            tokens, vocab = args.tokens or SHAPES[name][3], SHAPES[name][4]
            ids, p = profile_ids(counts, vocab)
            mods, x = _modules(name, tokens, device)
            times, rows = {k: [] for k in mods}, []
            for r in range(args.warmup + args.rounds):
                u, tok = _load(mods, rng.choice(ids, size=tokens, p=p), SHAPES[name][1], device)
                rows.append(u)
                for k in list(mods)[r % 3:] + list(mods)[:r % 3]:  # order rotated each round
                    times[k].append(_time(mods[k], x, tok, vocab, device))
            rows = rows[args.warmup:]
            ms = {k: statistics.median(v[args.warmup:]) * 1e3 for k, v in times.items()}
            results.append({"model": name, "tokens": tokens, "rows": int(statistics.median(rows)),
                            "rows_range": [min(rows), max(rows)],
                            "expected_rows": expected_distinct_ids(counts, vocab, (tokens,))[0],
                            "device": str(device), "ms": ms, "over_dense": {k: ms[k] / ms["dense"] for k in ms}})
    finally:
        parallel.destroy()
    if args.json == "-":
        print(json.dumps(results, indent=2))
        return
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    for r in results:
        d, d_ff = SHAPES[r["model"]][:2]
        lo, hi = r["rows_range"]
        print(f"{r['model']} FFN (d {d}, d_ff {d_ff}), {r['tokens']:,} tokens, {lo:,}-{hi:,} distinct ids a round "
              f"(median {r['rows']:,}; {r['expected_rows']:,} expected), {r['device']}, forward + backward, median of "
              f"{args.rounds}:")
        for k, v in r["ms"].items():
            print(f"  {k:<13} {v:9.2f} ms   {r['over_dense'][k]:.2f}x dense")


if __name__ == "__main__":
    main()
