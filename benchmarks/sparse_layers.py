"""Dense vs STEM-1/3 vs Hash-MoE-1/3 on two real processes: step time, bytes communicated, memory placement.

STEM and Hash-MoE both add parameters that a token uses only a slice of. They differ in where those
parameters live and what crosses the network: STEM keeps its tables ``U_l`` in host memory and syncs
only the rows the global batch touched (union of ids + one all-reduce), Hash-MoE keeps its experts on
the compute devices, spread by expert parallelism, and moves every token's hidden state to its expert
and back (all-to-all). This script runs all three variants of the same tiny model on the same batches
in ONE pair of gloo processes (world=2, megatron initialised once with EP=2: dense and STEM train as
DP=2 and never use the expert groups; Hash-MoE's experts are split 4+4 over the two ranks, so its
all-to-all really crosses processes) and reports, per variant:

1. step time (``train_step``: megatron schedule, DDP/distributed-optimizer sync, optimizer, and for
   STEM the row sync + CPU Adam), as a ratio to dense: variants are interleaved round by round (order
   rotated), a round's time is the slower rank's, ratios are medians of per-round ratios (with IQR);
2. bytes sent per step per rank, *computed*: dense gradient sync = 4 x (grad elements) x 2(n-1)/n per
   sync group of n ranks (ring all-reduce; megatron's distributed optimizer does reduce-scatter of the
   grads + all-gather of the params, the same total), plus the store's ``stem_bytes_sent`` for STEM and
   ``take_moe_stats``' ``moe_all_to_all_bytes`` for Hash-MoE; next to it, *observed*: the tensor sizes
   of every collective call made during the step (``torch.distributed`` and megatron's bound
   all-gather/reduce-scatter functions wrapped), converted to ring-equivalent bytes sent per rank;
3. parameter bytes on the compute device per rank (the megatron model's parameters; CPU here, but the
   same tensors a GPU would hold) and, for STEM, the host store's bytes per node (``U_l`` plus its two
   Adam moments, shared by the node's ranks).

Hash-MoE uses 8 experts (16, the config default, is too slow on 2 CPU cores) with the expert width
chosen so its total parameter count equals STEM-1/3's exactly (``matched_expert_ffn``: per replaced
layer ``E * 3 d d_e = 2 d d_ff + V d_ff``, so d_e = 576 for d=256, d_ff=768, V=4096, E=8). A token
runs one expert, so Hash-MoE's per-token FFN FLOPs there are d_e/d_ff = 3/4 of dense, STEM's 2/3.

Batches come from the prepared corpus (``--corpus``; the real token distribution decides how many
distinct ids STEM syncs).

Run: ``.venv/bin/python benchmarks/sparse_layers.py [--rounds N] [--json]`` (CPU, spawns 2 processes).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's stem_megatron, installed or not
from stem_megatron.setup_check import require_environment  # noqa: E402

require_environment()  # before torch and megatron: another Python gets `make setup`, not a traceback

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import distributed  # noqa: E402 - tests/distributed.py: spawns gloo ranks with megatron initialised

from stem_megatron.config import (  # noqa: E402
    ConfigError,
    DataConfig,
    HashMoEConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    STEMConfig,
    TrainConfig,
    validate,
)

MODEL = ModelConfig(name="bench", num_layers=6, hidden_size=256, ffn_hidden_size=768, num_attention_heads=4,
                    vocab_size=4096, seq_length=128)
WORLD, EP, MICRO_BATCH, GLOBAL_BATCH = 2, 2, 8, 16
EXPERTS = 8
SEED = 1234


def matched_expert_ffn(model: ModelConfig, experts: int) -> int:
    """Expert d_ff giving Hash-MoE the same total parameters as STEM: per replaced layer STEM has
    ``W_g, W_d`` (2 d d_ff) + ``U_l`` (V d_ff), Hash-MoE ``experts`` SwiGLU FFNs (3 d d_e each)."""
    d, f, v = model.hidden_size, model.ffn_hidden_size, model.vocab_size
    stem_layer = 2 * d * f + v * f
    if stem_layer % (3 * d * experts):
        raise ValueError(f"no integer expert d_ff matches STEM with {experts} experts")
    return stem_layer // (3 * d * experts)


def configs(rounds: int, warmup: int, corpus: Path) -> dict[str, RunConfig]:
    expert_ffn = matched_expert_ffn(MODEL, EXPERTS)
    train = TrainConfig(steps=rounds + warmup, micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH,
                        lr=1e-3, seed=SEED)
    stems = {
        "dense": (STEMConfig(variant="dense"), ParallelConfig()),
        "stem-1/3": (STEMConfig(variant="stem", ratio="1/3"), ParallelConfig()),  # host tables (the default placement)
        "hash-moe-1/3": (STEMConfig(variant="hash_moe", ratio="1/3"), ParallelConfig(expert_model_parallel_size=EP)),
    }
    data = DataConfig(dir=str(corpus))
    experts = HashMoEConfig(num_experts=EXPERTS, expert_ffn_hidden_size=expert_ffn)
    return {name: RunConfig(model=MODEL, stem=s, hash_moe=experts, parallel=p, train=train, data=data)
            for name, (s, p) in stems.items()}


# ---- observed collective traffic ----

def _ring_bytes(op: str, a: dict, n: int, rank: int) -> float:
    """Bytes this rank sends for one call, as a ring (all-reduce, reduce-scatter, all-gather) or
    direct (all-to-all) algorithm would: what a call's tensor sizes imply, not a wire capture."""

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes(a["tensor"])
    if op == "all_gather":
        return (n - 1) * nbytes(a["tensor"])
    if op == "all_gather_into_tensor":
        return (n - 1) * nbytes(a["input_tensor"])
    if op == "reduce_scatter_tensor":
        return (n - 1) * nbytes(a["output"])
    if op == "all_to_all_single":
        x, splits = a["input"], a.get("input_split_sizes")
        if splits is None:
            return (n - 1) / n * nbytes(x)
        splits = [int(k) for k in splits]  # a list, or numpy array on CPU (cpu_compat)
        row = nbytes(x) // max(x.shape[0], 1)
        return (sum(splits) - splits[rank]) * row
    raise ValueError(op)


class CollectiveTally:
    """Wraps the collectives megatron and the STEM store call; while ``variant`` is set, adds each
    call's ring-equivalent bytes (and one call) under (variant, op); groups of one rank send nothing."""

    OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")

    def __init__(self):
        import megatron.core.distributed.param_and_grad_buffer as buffer_mod
        import megatron.core.tensor_parallel.mappings as mappings_mod
        import torch.distributed as dist

        self.variant = None
        self.bytes, self.calls = collections.Counter(), collections.Counter()
        wrapped = {}
        for op in self.OPS:
            wrapped[getattr(dist, op)] = self._wrap(dist, op)
            setattr(dist, op, wrapped[getattr(dist, op)])
        for mod in (buffer_mod, mappings_mod):  # they bind all-gather/reduce-scatter at import
            for name in ("dist_all_gather_func", "dist_reduce_scatter_func"):
                owner, attr = mod, name
                if getattr(getattr(mod, name), "one_rank_identity", False):  # cpu_compat's skip of one-rank DP
                    owner, attr = getattr(mod, name), "collective"
                fn = getattr(owner, attr)
                if fn not in wrapped:
                    raise RuntimeError(f"{mod.__name__}.{name} is {fn}, not a wrapped torch collective: "
                                       f"the observed bytes would miss it")
                setattr(owner, attr, wrapped[fn])

    def _wrap(self, dist, op):
        fn = getattr(dist, op)
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if self.variant is not None:
                bound = signature.bind(*args, **kwargs)
                group = bound.arguments.get("group")
                n = dist.get_world_size(group)
                if n > 1:
                    self.bytes[self.variant, op] += _ring_bytes(op, bound.arguments, n, dist.get_rank(group))
                    self.calls[self.variant, op] += 1
            return fn(*args, **kwargs)

        return call


# ---- the two ranks ----

def _batches(corpus: Path, dp_rank: int, dp: int, n_micro: int, samples: int):
    from stem_megatron.data.batches import micro_batches
    from stem_megatron.data.datasets import build_datasets
    from stem_megatron.data.tokenizer import HFTokenizer

    train, _ = build_datasets(HFTokenizer(corpus / "tokenizer.json"), [(1.0, str(corpus / "train"))],
                              MODEL.seq_length, samples, SEED, corpus / "index_cache", MODEL.vocab_size)
    return micro_batches(train, MICRO_BATCH, dp_rank, dp, num_micro_batches=n_micro)


def _static(trainer) -> dict:
    """Parameter placement and the computed dense-gradient sync bytes of one rank's model."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    expert_dp = parallel_state.get_expert_data_parallel_world_size()
    params = list(trainer.model.parameters())
    # megatron marks expert params allreduce=False: their grads sync over the expert-DP group
    dense = sum(p.numel() for p in params if getattr(p, "allreduce", True))
    expert = sum(p.numel() for p in params if not getattr(p, "allreduce", True))
    grad_bytes = 4  # grad_reduce_in_fp32; ring all-reduce (= reduce-scatter + all-gather) sends 2(n-1)/n
    return {
        "device_param_bytes": sum(p.numel() * p.element_size() for p in params),
        "dense_params": dense,
        "local_expert_params": expert,
        "grad_sync_bytes": grad_bytes * (dense * 2 * (dp - 1) / dp + expert * 2 * (expert_dp - 1) / expert_dp),
        "dp": dp, "expert_dp": expert_dp,
        "host_table_bytes": trainer.tables.host_bytes,
        "host_table_weight_bytes": (sum(w.numel() * w.element_size() for w in trainer.tables.record.read.values())
                                    if trainer.tables.hosted else 0),
    }


def _bench(cfgs: dict, rounds: int, warmup: int) -> dict:
    """One rank: build the three trainers, step them round-robin, return times and byte counts."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from stem_megatron.model.hash_moe import take_moe_stats
    from stem_megatron.training.setup import setup_model
    from stem_megatron.training.step import train_step

    tally = CollectiveTally()
    trainers = {name: setup_model(cfg) for name, cfg in cfgs.items()}
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    n_micro = GLOBAL_BATCH // (MICRO_BATCH * dp)
    samples = next(iter(cfgs.values())).train.steps * GLOBAL_BATCH
    streams, data = contextlib.ExitStack(), {}
    for name, trainer in trainers.items():  # the same batches for every variant
        data[name] = streams.enter_context(
            trainer.tables.stream(_batches(Path(cfgs[name].data.dir), dp_rank, dp, n_micro, samples), n_micro))
    out = {name: {"static": _static(t), "times": [], "stem_bytes_sent": [], "stem_bytes_to_device": [],
                  "moe_all_to_all_bytes": [], "loss": []} for name, t in trainers.items()}
    names = list(trainers)
    try:
        for r in range(warmup + rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                trainer, timed = trainers[name], r >= warmup
                dist.barrier()
                tally.variant = name if timed else None
                start = time.perf_counter()
                step = train_step(trainer, data[name], n_micro, MICRO_BATCH, MODEL.seq_length, MODEL.vocab_size)
                elapsed = time.perf_counter() - start
                tally.variant = None
                stem = trainer.tables.take_stats()
                moe = take_moe_stats(trainer.model)
                if timed:
                    rec = out[name]
                    rec["times"].append(elapsed)
                    rec["loss"].append(step["loss"])
                    rec["stem_bytes_sent"].append(stem.get("stem_bytes_sent", 0))
                    rec["stem_bytes_to_device"].append(stem.get("stem_bytes_to_device", 0))
                    rec["moe_all_to_all_bytes"].append(moe.get("moe_all_to_all_bytes", 0))
    finally:
        streams.close()
    for name in names:
        out[name]["observed"] = {op: b / rounds for (v, op), b in tally.bytes.items() if v == name}
        out[name]["observed_calls"] = {op: c / rounds for (v, op), c in tally.calls.items() if v == name}
    out["ep_rank"] = parallel_state.get_expert_model_parallel_rank()
    return out


# ---- parent: combine the ranks ----

def summarize(ranks: list[dict], rounds: int) -> dict:
    names = [k for k in ranks[0] if k != "ep_rank"]
    mean = statistics.mean
    result = {}
    # a round's time is the slower rank's (the ranks meet at every collective)
    times = {n: [max(r[n]["times"][i] for r in ranks) for i in range(rounds)] for n in names}
    for n in names:
        s = ranks[0][n]["static"]
        sparse = mean(mean(r[n]["stem_bytes_sent"]) + mean(r[n]["moe_all_to_all_bytes"]) for r in ranks)
        observed = {op: mean(r[n]["observed"].get(op, 0.0) for r in ranks)
                    for op in sorted({op for r in ranks for op in r[n]["observed"]})}
        local_experts = [r[n]["static"]["local_expert_params"] for r in ranks]
        # experts: each lives on one rank of every expert-DP group; tables: one U_l per STEM layer
        total_params = (s["dense_params"] + sum(local_experts) // s["expert_dp"]
                        + s["host_table_weight_bytes"] // 4)
        result[n] = {
            "step_s": statistics.median(times[n]),
            "total_params": total_params,
            "device_param_bytes_per_rank": mean(r[n]["static"]["device_param_bytes"] for r in ranks),
            "host_table_bytes_per_node": s["host_table_bytes"],
            "host_table_weight_bytes_per_node": s["host_table_weight_bytes"],
            "grad_sync_bytes": s["grad_sync_bytes"],
            "sparse_bytes": sparse,
            "computed_bytes": s["grad_sync_bytes"] + sparse,
            "observed_bytes": sum(observed.values()),
            "observed_by_op": observed,
            "observed_calls_per_step": ranks[0][n]["observed_calls"],
            "stem_bytes_to_device": mean(mean(r[n]["stem_bytes_to_device"]) for r in ranks),
            "last_loss": ranks[0][n]["loss"][-1],
        }
        if n != "dense":
            ratios = [t / d for t, d in zip(times[n], times["dense"], strict=True)]
            result[n]["time_ratio"] = statistics.median(ratios)
            result[n]["time_ratio_iqr"] = statistics.quantiles(ratios, n=4)[::2]
    return result


def print_table(res: dict, rounds: int, seconds: float, source: str, expert_ffn: int) -> None:
    m, MB = MODEL, 1e6
    print(f"Model: {m.num_layers} layers, d={m.hidden_size}, d_ff={m.ffn_hidden_size}, {m.num_attention_heads} "
          f"heads, V={m.vocab_size}, seq {m.seq_length}; global batch {GLOBAL_BATCH} = {WORLD} ranks x "
          f"micro-batch {MICRO_BATCH}; batches: {source}")
    print(f"2 gloo processes, 1 torch thread each, megatron EP={EP}; dense/STEM DP=2; Hash-MoE {EXPERTS} experts "
          f"of d_ff={expert_ffn} (4 per rank, total params = STEM-1/3's); {rounds} timed rounds")
    print(f"\n  {'':13}{'total params':>13}{'device MB/rank':>15}{'host MB/node':>13}{'step ms':>9}"
          f"{'time vs dense (IQR)':>22}")
    for n, r in res.items():
        ratio = ""
        if "time_ratio" in r:
            q1, q3 = r["time_ratio_iqr"]
            ratio = f"{r['time_ratio']:.2f} ({q1:.2f}-{q3:.2f})"
        host = f"{r['host_table_bytes_per_node'] / MB:.1f}" if r["host_table_bytes_per_node"] else "-"
        print(f"  {n:13}{r['total_params']:>13,}{r['device_param_bytes_per_rank'] / MB:>15.1f}{host:>13}"
              f"{r['step_s'] * 1e3:>9.0f}{ratio:>22}".rstrip())
    print(f"\n  MB sent per step per rank{'':4}{'grad sync':>10}{'+ sparse':>10}{'= computed':>11}{'observed':>10}"
          f"{'computed/dense':>16}{'observed/dense':>16}")
    dense = res["dense"]
    for n, r in res.items():
        sparse = {"dense": "", "stem-1/3": " (row sync)", "hash-moe-1/3": " (all-to-all)"}.get(n, "")
        print(f"  {n + sparse:29}{r['grad_sync_bytes'] / MB:>10.2f}{r['sparse_bytes'] / MB:>10.2f}"
              f"{r['computed_bytes'] / MB:>11.2f}{r['observed_bytes'] / MB:>10.2f}"
              f"{r['computed_bytes'] / dense['computed_bytes']:>15.2f}x"
              f"{r['observed_bytes'] / dense['observed_bytes']:>15.2f}x")
    print("  observed, MB by collective (calls per step):")
    for n, r in res.items():
        calls = r["observed_calls_per_step"]
        ops = ", ".join(f"{op} {b / MB:.2f} ({calls.get(op, 0):g})" for op, b in r["observed_by_op"].items())
        print(f"    {n:13}{ops}")
    s = res["stem-1/3"]
    print(f"\n  STEM host tables: {s['host_table_weight_bytes_per_node'] / MB:.1f} MB of U_l "
          f"({s['host_table_bytes_per_node'] / MB:.1f} MB with Adam moments), node-shared; rows copied to the "
          f"compute device per step per rank: {s['stem_bytes_to_device'] / MB:.2f} MB")
    print(f"\n(total run time {seconds:.0f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds (one step of every variant each)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds before timing")
    parser.add_argument("--corpus", type=Path, default=Path("data_cache/python-doc"))
    parser.add_argument("--json", action="store_true", help="print a JSON dict instead of the tables")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (the time ratios report quartiles)")
    start = time.perf_counter()
    cfgs = configs(args.rounds, args.warmup, args.corpus.resolve())
    try:
        for cfg in cfgs.values():
            validate(cfg, WORLD)
    except ConfigError as e:  # e.g. no corpus in --corpus: the message names the fix
        parser.error(str(e))
    source = f"corpus {args.corpus}"
    ranks = distributed.run(_bench, WORLD, cfgs, args.rounds, args.warmup, ep=EP, seed=SEED)
    res = summarize(ranks, args.rounds)
    seconds = time.perf_counter() - start
    expert_ffn = cfgs["hash-moe-1/3"].hash_moe.expert_ffn_hidden_size
    if args.json:
        print(json.dumps({"variants": res, "rounds": args.rounds, "batches": source, "experts": EXPERTS,
                          "expert_ffn_hidden_size": expert_ffn, "run_time_s": seconds}, indent=2))
    else:
        print_table(res, args.rounds, seconds, source, expert_ffn)


if __name__ == "__main__":
    main()
