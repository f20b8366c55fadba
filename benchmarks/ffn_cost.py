"""Compute cost of a STEM FFN vs a dense SwiGLU FFN, counted and timed on the real megatron-core modules.

STEM replaces the up-projection ``W_u x`` of SwiGLU by a row lookup ``U_l[t]``, so one FFN does two
matmuls instead of three: its per-token matmul FLOPs are exactly 2/3 of dense, forward and backward.
This script checks that claim and shows what it buys on a whole model:

1. matmul FLOPs per token of one dense MLP and one STEM MLP (``torch.utils.flop_counter``), forward
   and forward+backward; the ratio is asserted to be exactly 2/3;
2. forward+backward time per token of a tiny GPTModel, dense vs STEM-1/3 vs STEM-full: a training
   step without the optimizer (zero the DDP grad buffer, then the training code's ``forward_backward``,
   i.e. megatron's schedule and DDP grad sync), next to the whole-model matmul FLOP ratio.
   Variants are timed round-robin (order rotated each round); times are medians over rounds and
   time ratios medians of the per-round ratios (with their quartiles), so machine noise hits all
   variants alike.

Run: ``.venv/bin/python benchmarks/ffn_cost.py [--steps N] [--json]`` (CPU, one process).
"""

from __future__ import annotations  # noqa: I001 - stem_megatron (its warning filters) before megatron

import argparse
import itertools
import json
import statistics
import sys
import time
from fractions import Fraction
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's stem_megatron, installed or not
from stem_megatron.setup_check import require_environment  # noqa: E402

require_environment()  # before torch and megatron: another Python gets `make setup`, not a traceback

import torch  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from stem_megatron import parallel  # noqa: E402
from stem_megatron.config import (  # noqa: E402
    HostTablesConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    STEMConfig,
    TrainConfig,
)
from stem_megatron.model.gpt import transformer_config  # noqa: E402
from stem_megatron.model.specs import stem_mlp_spec  # noqa: E402
from stem_megatron.model.token_context import token_ids  # noqa: E402
from stem_megatron.training.setup import setup_model  # noqa: E402
from stem_megatron.training.step import forward_backward  # noqa: E402

MODEL = ModelConfig(name="bench", num_layers=6, hidden_size=256, ffn_hidden_size=768, num_attention_heads=4,
                    vocab_size=4096, seq_length=128)
MICRO_BATCH = 8
VARIANTS = {
    "dense": STEMConfig(variant="dense"),
    "stem-1/3": STEMConfig(variant="stem", ratio="1/3"),
    "stem-full": STEMConfig(variant="stem", ratio="full"),
}
ON_DEVICE = HostTablesConfig(placement="device")  # every variant's tables
SEED = 1234


def count_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def mlp_flops(mlp, tokens: torch.Tensor) -> dict:
    """Forward and forward+backward FLOPs per token of one MLP on ``tokens`` [b, s]."""
    b, s = tokens.shape
    x = torch.randn(s, b, MODEL.hidden_size, requires_grad=True)  # as in the model: the input needs a gradient

    def forward():
        with token_ids(tokens, MODEL.vocab_size):
            return mlp(x)[0]

    fwd = count_flops(forward)
    fwd_bwd = count_flops(lambda: forward().backward(torch.randn_like(x)))
    return {"fwd": fwd // (s * b), "fwd_bwd": fwd_bwd // (s * b)}


def ffn_flops() -> dict:
    """Matmul FLOPs per token of one dense and one STEM MLP; asserts STEM/dense == 2/3 exactly."""
    config = transformer_config(MODEL, ParallelConfig(), on_gpu=False)
    # megatron-core 0.19's local layer spec gives the dense MLP as the factory its TransformerLayer calls
    dense = get_gpt_layer_local_spec(normalization="RMSNorm").submodules.mlp(
        config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"]),
        is_mtp_layer=False, ffn_hidden_size=MODEL.ffn_hidden_size)
    stem = build_module(stem_mlp_spec("stem", MODEL.vocab_size), config=config)
    tokens = torch.randint(0, MODEL.vocab_size, (MICRO_BATCH, MODEL.seq_length))
    result = {"dense": mlp_flops(dense, tokens), "stem": mlp_flops(stem, tokens)}
    for phase in ("fwd", "fwd_bwd"):
        ratio = Fraction(result["stem"][phase], result["dense"][phase])
        assert ratio == Fraction(2, 3), f"STEM/dense {phase} matmul FLOPs = {ratio}, expected exactly 2/3"
        result[f"ratio_{phase}"] = ratio
    return result


def model_cost(steps: int, warmup: int) -> dict:
    """Whole-model forward+backward matmul FLOPs and median time per token of each variant."""
    tokens_per_step = MICRO_BATCH * MODEL.seq_length
    train = TrainConfig(micro_batch_size=MICRO_BATCH, global_batch_size=MICRO_BATCH, seed=SEED)
    models = {name: setup_model(RunConfig(model=MODEL, stem=stem, host_tables=ON_DEVICE, train=train)).model
              for name, stem in VARIANTS.items()}
    batch = torch.randint(0, MODEL.vocab_size, (MICRO_BATCH, MODEL.seq_length + 1))
    data = itertools.repeat({"tokens": batch[:, :-1].contiguous(), "labels": batch[:, 1:].contiguous()})

    def step(model):
        model.zero_grad_buffer()
        forward_backward(model, data, 1, MICRO_BATCH, MODEL.seq_length, MODEL.vocab_size)

    flops = {name: count_flops(partial(step, model)) // tokens_per_step for name, model in models.items()}
    for _ in range(warmup):
        for model in models.values():
            step(model)
    times = {name: [] for name in models}
    names = list(models)
    for r in range(steps):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            step(models[name])
            times[name].append((time.perf_counter() - start) / tokens_per_step)
    result = {name: {"flops_per_token": flops[name], "time_per_token_us": 1e6 * statistics.median(times[name]),
                     "params": sum(p.numel() for p in models[name].parameters())} for name in names}
    for name in names[1:]:
        ratios = [t / d for t, d in zip(times[name], times["dense"], strict=True)]
        result[name]["flop_ratio"] = Fraction(flops[name], flops["dense"])
        result[name]["time_ratio"] = statistics.median(ratios)
        result[name]["time_ratio_quartiles"] = statistics.quantiles(ratios, n=4)[::2]
    return result


def print_table(ffn: dict, model: dict, steps: int, seconds: float) -> None:
    m = MODEL
    print(f"One FFN (d={m.hidden_size}, d_ff={m.ffn_hidden_size}), matmul FLOPs per token:")
    print(f"  {'':10}{'dense':>12}{'STEM':>12}{'STEM/dense':>12}")
    for phase, label in (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd")):
        print(f"  {label:10}{ffn['dense'][phase]:>12,}{ffn['stem'][phase]:>12,}{str(ffn['ratio_' + phase]):>12}")
    print(f"\nWhole model ({m.num_layers} layers, d={m.hidden_size}, d_ff={m.ffn_hidden_size}, V={m.vocab_size}, "
          f"{MICRO_BATCH}x{m.seq_length} tokens/step), forward+backward, median of {steps} rounds, "
          f"torch threads: {torch.get_num_threads()}")
    print(f"  {'':10}{'params':>12}{'MFLOP/tok':>11}{'us/tok':>9}{'FLOP ratio':>18}{'time ratio (IQR)':>24}")
    for name, r in model.items():
        flop_ratio = f"{str(r['flop_ratio'])} = {float(r['flop_ratio']):.3f}" if "flop_ratio" in r else ""
        time_ratio = ""
        if "time_ratio" in r:
            q1, q3 = r["time_ratio_quartiles"]
            time_ratio = f"{r['time_ratio']:.3f} ({q1:.3f}-{q3:.3f})"
        print(f"  {name:10}{r['params']:>12,}{r['flops_per_token'] / 1e6:>11.2f}{r['time_per_token_us']:>9.1f}"
              f"{flop_ratio:>18}{time_ratio:>24}")
    print(f"\n(total run time {seconds:.0f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15, help="timed rounds (one step of every variant each)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds before timing")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 keeps timings stable when other processes share the cores")
    parser.add_argument("--json", action="store_true", help="print a JSON dict instead of the table")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the time ratios report quartiles)")
    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    parallel.single_process_env()
    parallel.initialize(tp=1, pp=1, seed=SEED)
    try:
        ffn = ffn_flops()
        model = model_cost(args.steps, args.warmup)
    finally:
        parallel.destroy()
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({"ffn": ffn, "model": model, "steps": args.steps, "run_time_s": seconds},
                         default=str, indent=2))
    else:
        print_table(ffn, model, args.steps, seconds)


if __name__ == "__main__":
    main()
