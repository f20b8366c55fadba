"""STEM row sync across nodes: bytes per node and CPU-Adam rows per node, per optimizer step.

Each row has one owner node ("owner": host_tables/ownership.py, exchange.py), against the design where
every DP rank all-reduces the union of touched rows and every node updates all of them ("replicated", not
built). This script shows how the two scale with nodes next to what STEM replaces (the dense
``W_u`` gradient sync) and to its sparse rival (Hash-MoE's token all-to-all):

(a) emulated: the store's real exchange on N = 1, 2, 4 emulated nodes (one process each, gloo), token
    ids drawn from the 128k-vocabulary counts, its measured bytes and Adam rows per node next to the
    model below evaluated for the same draws (expected distinct ids and staleness from the counts).
(b) projected: the model for the paper's 1B STEM-1/3, fed with D(B), the distinct ids in a batch of B
    tokens, at two ends: "realistic" (distinct ids measured on packed sequences, benchmarks/data/README.md)
    and "upper" (Zipf law, exponent 1.1, over the whole vocabulary). D(B) sampled from the per-id counts
    is printed beside them as a check.

Only inter-node traffic counts (NVLink and host copies inside a node are free here); "bytes per node"
are the bytes one node sends per step, which equal what it receives (every pattern below is symmetric).

Run: ``.venv/bin/python benchmarks/row_sync.py [--counts PATH] [--json PATH] [--nodes 1,2,4]`` (about a
minute on 2 CPU cores; ``--nodes ''`` skips the emulation).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's stem_megatron, installed or not
from stem_megatron.setup_check import require_environment  # noqa: E402

require_environment()  # before torch and megatron: another Python gets `make setup`, not a traceback

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.distributed.elastic.utils.distributed import get_free_port  # noqa: E402

from stem_megatron.flops.distinct import expected_distinct  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_COUNTS = REPO / "benchmarks" / "data" / "token_counts_128k.npy"  # a 128k BPE's per-id counts: its README
GB = 1e9
ID_BYTES = 8  # int64 ids, as the exchange sends them
FP32, BF16 = 4, 2

# Distinct ids on random packed 4096-token sequences, 128k BPE (the counts file's tokenizer):
# benchmarks/data/README.md, "64k" read as 65,536 tokens and so on.
PACKED_DISTINCT = {2**16: 6_380, 2**18: 12_646, 2**19: 16_579, 2**20: 20_865, 2**21: 25_040, 2**22: 29_522}
ZIPF_EXPONENT = 1.1  # pure Zipf (Mandelbrot offset 0): gives the README's ~99k distinct ids at 2M tokens
GPUS = (8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Setup:
    """The paper's 1B STEM-1/3 (Llama3.2-1B widths, 1/3 of 16 FFNs replaced), paper Table 2's batch."""

    d: int = 2048
    d_ff: int = 8192
    layers: int = 16
    stem_layers: int = 5
    vocab: int = 128_256
    tokens: int = 512 * 4096  # global batch per optimizer step
    gpus_per_node: int = 8
    tp: int = 1


# ---------------------------------------------------------------- D(B): distinct ids in B tokens
def packed_distinct(tokens: float, vocab: int) -> float:
    """The README's packed-sequence measurement, interpolated log-log (end slopes beyond its range)."""
    b, d = np.log(list(PACKED_DISTINCT)), np.log(list(PACKED_DISTINCT.values()))
    x = np.log(tokens)
    i = int(np.clip(np.searchsorted(b, x) - 1, 0, len(b) - 2))
    y = d[i] + (d[i + 1] - d[i]) / (b[i + 1] - b[i]) * (x - b[i])
    return float(min(np.exp(y), tokens, vocab))


@functools.lru_cache(maxsize=4)
def _zipf(vocab: int) -> np.ndarray:
    p = np.arange(1, vocab + 1, dtype=np.float64) ** -ZIPF_EXPONENT
    return p / p.sum()


def zipf_distinct(tokens: float, vocab: int) -> float:
    """Upper bound: independent draws from a Zipf law over the whole vocabulary (web text is below it)."""
    return expected_distinct(_zipf(vocab), tokens)


def sampled_distinct(counts: np.ndarray, tokens: int, draws: int = 3, seed: int = 0) -> float:
    """Distinct ids in ``tokens`` ids drawn independently from ``counts`` (mean of ``draws``). Independent
    draws ignore that a document repeats its own words, so this overstates D(B): for the counts file by
    10% at 2M tokens and 44% at 64k against the packed measurement."""
    rng = np.random.default_rng(seed)
    p = counts / counts.sum()
    return float(np.mean([np.count_nonzero(rng.multinomial(tokens, p)) for _ in range(draws)]))


ENDS = {"realistic": packed_distinct, "upper": zipf_distinct}


# ---------------------------------------------------------------- the model, one function per design
def nodes_of(s: Setup, gpus: int) -> int:
    if gpus % s.gpus_per_node or gpus % s.tp:
        raise ValueError(f"{gpus} GPUs are not whole nodes of {s.gpus_per_node} / a multiple of TP={s.tp}")
    return gpus // s.gpus_per_node


def replicated(s: Setup, gpus: int, distinct) -> tuple[float, float]:
    """The replicated design (not built): per STEM layer each TP rank's DP group (n = gpus/tp ranks)
    all-gathers its id lists and ring-all-reduces an fp32 ``D(T) x d_ff/tp`` buffer of the global union.

    A ring over ranks ordered node by node leaves a node over one link, which carries what one rank
    sends: 2(n-1)/n of the buffer for the all-reduce, (n-1) id lists of D(T/n) ids for the all-gather
    (NCCL's parallel rings each carry a slice, so the sum is the same). The tp rings move d_ff/tp
    columns each, so per node::

        bytes = L * [2(n-1)/n * D(T) * d_ff * 4  +  tp * (n-1) * D(T/n) * 8]     (0 on one node)
        CPU-Adam rows = L * D(T)                                                 (every node, every union row)
    """
    nodes, n = nodes_of(s, gpus), gpus // s.tp
    union = distinct(s.tokens, s.vocab)
    rows = 2 * (n - 1) / n * union * s.d_ff * FP32
    ids = s.tp * (n - 1) * distinct(s.tokens / n, s.vocab) * ID_BYTES
    return (s.stem_layers * (rows + ids) if nodes > 1 else 0.0), s.stem_layers * union


def owner(s: Setup, gpus: int, distinct, grad_bytes: int, row_bytes: int = FP32) -> tuple[float, float]:
    """The owner design, as built: each row has one owner node. A node's ranks merge their row gradients by id
    inside the node, so a node touches D(T/N) rows per STEM layer and a share (N-1)/N of them has
    another owner. Per step, per node (TP ranks send their column slices on their own rails, so rows
    sum to d_ff columns and ids are sent tp times)::

        gradients  L * (N-1)/N * D(T/N) * (d_ff * grad_bytes + 8 tp)     to the owners
        stale ids  tp * (N-1) * D(T)/N * 8                               each owner's updated ids, to all
        pull       (N-1)/N * D(T/N) * f * (8 tp + L * d_ff * row_bytes)  requests, and rows served
        CPU-Adam rows = L * D(T) / N                                     (its share of the union)

    ``f``, the share of the rows a node reads that changed since it last read them: a row is stale once
    anyone touched it since the node's last pull, and the node touched every row it read, so f -> 1 in
    steady state; the projection takes f = 1 (the emulation measures the warm-up below 1).
    """
    nodes = nodes_of(s, gpus)
    remote = (nodes - 1) / nodes * distinct(s.tokens / nodes, s.vocab)
    grads = s.stem_layers * remote * (s.d_ff * grad_bytes + ID_BYTES * s.tp)
    stale_ids = s.tp * (nodes - 1) * distinct(s.tokens, s.vocab) / nodes * ID_BYTES
    pull = remote * (ID_BYTES * s.tp + s.stem_layers * s.d_ff * row_bytes)
    return grads + stale_ids + pull, s.stem_layers * distinct(s.tokens, s.vocab) / nodes


def dense_wu(s: Setup, gpus: int, distinct=None, grad_bytes: int = BF16) -> tuple[float, None]:
    """What STEM replaces: the dense up-projection W_u (d x d_ff) of each STEM layer, its gradient
    ring-all-reduced over DP in bf16 (megatron-core's DDP default; this project's optim.py reduces in
    fp32, twice the bytes; the distributed optimizer's reduce-scatter + all-gather moves the same
    2(n-1)/n). The optimizer runs on the GPU: no CPU-Adam rows::

        bytes = L * 2(n-1)/n * d * d_ff * 2                                       (0 on one node)
    """
    nodes, n = nodes_of(s, gpus), gpus // s.tp
    return (s.stem_layers * 2 * (n - 1) / n * s.d * s.d_ff * grad_bytes if nodes > 1 else 0.0), None


def hash_moe(s: Setup, gpus: int, distinct=None, ep: int = 16) -> tuple[float | None, None]:
    """Hash-MoE in the STEM layers' places, top-1 (token id -> expert), expert parallelism ``ep``:
    every token's hidden state (d, bf16) goes to its expert's rank and back (dispatch + combine), and
    the backward does the same: 4 passes. EP groups are ep * tp consecutive GPUs (megatron's rank
    order), so a node's experts are g/(ep * tp) of its group's and the rest of its T/N tokens leave::

        bytes = L * 4 * T/N * d * 2 * max(0, 1 - g/(ep * tp))                    (None if ep * tp > GPUs)

    Not counted: the expert weights' gradient sync over expert-DP (dense, grows with expert params).
    """
    nodes = nodes_of(s, gpus)
    if ep * s.tp > gpus:
        return None, None
    leaving = max(0.0, 1 - s.gpus_per_node / (ep * s.tp))
    return s.stem_layers * 4 * s.tokens / nodes * s.d * BF16 * leaving, None


DESIGNS = {
    "replicated": replicated,
    "owner_fp32": functools.partial(owner, grad_bytes=FP32),
    "owner_bf16": functools.partial(owner, grad_bytes=BF16),
    "dense_wu": dense_wu,
    "hash_moe_ep8": functools.partial(hash_moe, ep=8),
    "hash_moe_ep16": functools.partial(hash_moe, ep=16),
}


def record(kind: str, design: str, s: Setup, gpus: int, bytes_per_node, model_bytes_per_node, adam_rows,
           end: str) -> dict:
    """One JSON record. ``model_bytes_per_node`` is the model's figure beside a measured (emulated) one;
    projected records are the model, so it is null there."""
    def whole(x):
        return None if x is None else round(x)

    return {"kind": kind, "design": design, "nodes": nodes_of(s, gpus), "gpus": gpus,
            "bytes_per_node": whole(bytes_per_node), "model_bytes_per_node": whole(model_bytes_per_node),
            "adam_rows_per_node": whole(adam_rows), "d_of_b": end}


def projected(s: Setup, gpus=GPUS) -> list[dict]:
    """Every design at every GPU count, at both ends of D(B); a design that cannot run there is left out."""
    out = []
    for end, fn in ENDS.items():
        for design, model in DESIGNS.items():
            for g in gpus:
                nbytes, rows = model(s, g, fn)
                if nbytes is not None:
                    out.append(record("projected", design, s, g, nbytes, None, rows, end))
    return out


# ---------------------------------------------------------------- (a) emulated nodes
@dataclass(frozen=True)
class Emulation:
    """N one-rank nodes (TP=1) training ``layers`` small STEM tables of the counts file's vocabulary."""

    tokens: int = 2**16  # global batch per step, split evenly over the nodes
    steps: int = 6
    layers: int = 2
    cols: int = 64


def emulated_model(p: np.ndarray, nodes: int, e: Emulation) -> tuple[float, float]:
    """``owner`` per node and step for ids drawn independently with probabilities ``p``, one rank per node,
    averaged over ``e.steps`` steps, with the small messages the exchange also sends (8-byte counts in
    every all-to-all, one padding id in the all-gather). Step k's pull is for step k+1: a row the node
    reads then is stale if anyone touched it in steps 1..k (nodes start with identical tables)."""
    if nodes == 1:
        return 0.0, e.layers * expected_distinct(p, e.tokens)
    with np.errstate(divide="ignore"):
        read = -np.expm1(e.tokens / nodes * np.log1p(-p))  # P(the node reads id t in a step)
        touched = -np.expm1(e.tokens * np.log1p(-p))  # P(any node touches id t in a step)
        stale = [float((read * -np.expm1(k * np.log1p(-touched))).sum()) for k in range(1, e.steps + 1)]
    remote, counts = (nodes - 1) / nodes, ID_BYTES * (nodes - 1)
    grads = e.layers * (remote * read.sum() * (e.cols * FP32 + ID_BYTES) + counts)
    stale_ids = (touched.sum() / nodes + 1) * ID_BYTES * (nodes - 1)
    pull = remote * np.mean(stale) * (ID_BYTES + e.layers * e.cols * FP32) + 2 * counts
    return float(grads + stale_ids + pull), e.layers * float(touched.sum()) / nodes


def token_batches(draw, steps: int) -> Iterator[dict]:
    """One micro-batch of ``draw(step)``'s tokens a step, for steps 1 to ``steps`` + 1 (the last one's rows are only
    announced: the step before makes them readable)."""
    return iter([{"tokens": draw(step)} for step in range(1, steps + 2)])


def backward_one_step(rows, store, grad: float = 1e-3, device_step: float = 0.0) -> None:
    """A step of one micro-batch through ``rows`` (the store's pipeline, ``HostTableStore.stream``) as training drives
    it, up to CPU Adam: the batch taken (the step begins), ``device_step`` seconds of the device's forward and backward
    (the prefetch thread works ahead meanwhile), the rows read with a constant gradient on each, merged and sent to
    their owners."""
    fetched = next(rows)["stem"]
    time.sleep(device_step)
    fetched.wait()  # its slots and step positions are the side stream's copies on GPU: as training's layer waits
    for layer in store.layers:
        leaf = store.rows(layer, fetched)
        leaf.backward(torch.full_like(leaf, grad))
    rows.reduce_gradients()


def _emulated_node(rank: int, nodes: int, port: int, p: np.ndarray, e: Emulation, out_dir: str) -> None:
    """One emulated node: the store's fetch, gradient exchange, CPU Adam and refresh, as training drives them."""
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(nodes), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GROUP_RANK=str(rank))  # GROUP_RANK: torchrun's node number
    torch.set_num_threads(1)
    from stem_megatron import parallel
    from stem_megatron.host_tables.store import HostTableStore, StoreConfig

    def draw(step: int) -> torch.Tensor:
        ids = np.random.default_rng([step, rank]).choice(len(p), size=e.tokens // nodes, p=p)
        return torch.from_numpy(ids).view(1, -1)

    parallel.initialize(1, 1, 0)
    try:
        store = HostTableStore(StoreConfig(tuple(range(1, e.layers + 1)), len(p), e.cols, init_std=0.02, seed=0))
        records = []
        with store.stream(token_batches(draw, e.steps), 1) as rows:
            for _ in range(e.steps):
                backward_one_step(rows, store)
                rows.step(1e-3)
                stats = store.take_stats()
                records.append((stats["stem_node_bytes_sent"], stats["stem_node_rows_updated"]))
    finally:
        parallel.destroy()
    torch.save(records, os.path.join(out_dir, f"{rank}.pt"))


def emulated(counts: np.ndarray, node_counts, e: Emulation = Emulation()) -> list[dict]:
    """Run the exchange on each node count; one record per count, measured next to the model."""
    import torch.multiprocessing as mp

    p = counts / counts.sum()
    out = []
    for nodes in node_counts:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_emulated_node, args=(nodes, get_free_port(), p, e, tmp), nprocs=nodes, join=True)
            per_node = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(nodes)]
        sent = float(np.mean([b for node in per_node for b, _ in node]))
        rows = float(np.mean([r for node in per_node for _, r in node]))
        model_bytes, model_rows = emulated_model(p, nodes, e)
        out.append({"kind": "emulated", "design": "owner_fp32", "nodes": nodes, "gpus": nodes,
                    "bytes_per_node": round(sent), "model_bytes_per_node": round(model_bytes),
                    "adam_rows_per_node": round(rows), "model_adam_rows_per_node": round(model_rows),
                    "d_of_b": "sampled from the counts file"})
    return out


def emulation_table(records: list[dict], e: Emulation) -> str:
    lines = [f"Emulated (one process per node, gloo): {e.tokens:,} tokens/step drawn from the counts, {e.layers} "
             f"STEM layers of {e.cols} columns, mean of {e.steps} steps",
             f"  {'nodes':>5}{'MB sent/node':>15}{'model':>10}{'ratio':>8}{'Adam rows/node':>17}{'model':>10}"
             f"{'ratio':>8}"]
    for r in records:
        ratio = f"{r['bytes_per_node'] / r['model_bytes_per_node']:.3f}" if r["model_bytes_per_node"] else "—"
        rows, model_rows = r["adam_rows_per_node"], r["model_adam_rows_per_node"]
        lines.append(f"  {r['nodes']:>5}{r['bytes_per_node'] / 1e6:>15.3f}{r['model_bytes_per_node'] / 1e6:>10.3f}"
                     f"{ratio:>8}{rows:>17,}{model_rows:>10,}{rows / model_rows:>8.3f}")
    return "\n".join(lines)


# ---------------------------------------------------------------- output for people
def distinct_table(s: Setup, counts: np.ndarray, gpus=GPUS) -> str:
    sizes = sorted({s.tokens // nodes_of(s, g) for g in gpus}, reverse=True)
    lines = [f"D(B), distinct ids in B tokens (B = a node's share of the {s.tokens:,}-token batch):",
             "  B tokens                         " + "".join(f"{b:>10,}" for b in sizes)]
    rows = {"sampled from the counts file": lambda b: sampled_distinct(counts, b),
            "realistic: packed sequences": lambda b: packed_distinct(b, s.vocab),
            f"upper: Zipf {ZIPF_EXPONENT} over V={s.vocab:,}": lambda b: zipf_distinct(b, s.vocab)}
    lines += [f"  {name:<33}" + "".join(f"{fn(b):>10,.0f}" for b in sizes) for name, fn in rows.items()]
    lines.append(f"  (independent draws overstate the packed measurement: documents repeat their own words; the "
                 f"counts file\n  has {np.count_nonzero(counts):,} ids that occur, so sampling saturates there)")
    return "\n".join(lines)


def projection_table(s: Setup, records: list[dict], gpus=GPUS) -> str:
    lines = [f"Projected per node per step: inter-node GB sent | CPU-Adam rows (all {s.stem_layers} STEM layers)",
             (f"d={s.d}, d_ff={s.d_ff}, {s.layers} layers, V={s.vocab:,}, {s.tokens:,} tokens/step, "
              f"{s.gpus_per_node} GPUs/node, TP={s.tp}, DP=GPUs/TP")]
    for end in ENDS:
        at = {(r["design"], r["gpus"]): r for r in records if r["d_of_b"] == end}
        lines.append(f"\n  D(B) {end:<10}" + "".join(f"{f'{g} GPUs':>16}" for g in gpus))
        for design in DESIGNS:
            cells = []
            for g in gpus:
                r = at.get((design, g))
                rows = "" if r is None or r["adam_rows_per_node"] is None else f"{r['adam_rows_per_node'] / 1e3:.0f}k"
                cells.append("—" if r is None else f"{r['bytes_per_node'] / GB:.2f} | {rows or '-':>5}")
            lines.append(f"  {design:<16}" + "".join(f"{c:>16}" for c in cells))
    lines.append("\n  one node (8 GPUs): nothing leaves the node; '—': EP=16 needs 16 GPUs; '-': no host tables "
                 "(optimizer on the GPU)")
    return "\n".join(lines)


def goal_check(s: Setup) -> list[str]:
    """The row sync's goal: at 64 GPUs the owner design sends <= 0.5x Hash-MoE EP=16's bytes per node, and less
    per node at 256 GPUs than at 64."""
    moe = hash_moe(s, 64, ep=16)[0]
    lines = [(f"Goal: owner <= 0.5x Hash-MoE EP=16 per node at 64 GPUs ({moe / GB:.2f} GB); "
              "less at 256 GPUs than at 64")]
    variants = {"owner_fp32": (FP32, FP32), "owner_bf16": (BF16, FP32),
                "owner_bf16 + bf16 copies": (BF16, BF16)}
    for end, fn in ENDS.items():
        for name, (grad, row) in variants.items():
            at64, at256 = (owner(s, g, fn, grad, row)[0] for g in (64, 256))
            ratio = at64 / moe
            lines.append(f"  {end:<9} {name:<28} {at64 / GB:5.2f} GB = {ratio:.2f}x MoE "
                         f"[{'met' if ratio <= 0.5 else 'NOT met'}]; 256 GPUs {at256 / GB:.2f} GB "
                         f"[{'met' if at256 < at64 else 'NOT met'}]")
    lines.append("  (owner_bf16: host_tables.wire_dtype=bf16; + bf16 copies: host_tables.read_dtype=bf16 too, rows "
                 "pulled in bf16)")
    return lines


def load_counts(path: Path) -> np.ndarray:
    if not path.is_file():
        raise SystemExit(f"row_sync.py: no token counts at {path}: pass --counts PATH (the repository's are "
                         f"{DEFAULT_COUNTS.relative_to(REPO)})")
    try:
        counts = np.load(path)
    except (OSError, ValueError) as err:
        raise SystemExit(f"row_sync.py: cannot read {path} as a .npy array ({err}); pass --counts PATH") from None
    if counts.ndim != 1 or counts.sum() <= 0 or (counts < 0).any():
        raise SystemExit(f"row_sync.py: {path} is not a 1-d array of per-id counts; pass --counts PATH")
    return counts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=Path, default=DEFAULT_COUNTS, help="per-id token counts (.npy)")
    parser.add_argument("--json", type=Path, help="also write the records here")
    parser.add_argument("--nodes", default="1,2,4", help="emulated node counts, comma-separated ('' skips)")
    parser.add_argument("--tokens", type=int, default=Emulation.tokens, help="emulated tokens per step")
    parser.add_argument("--steps", type=int, default=Emulation.steps, help="emulated steps")
    args = parser.parse_args(argv)
    counts = load_counts(args.counts)
    node_counts = [int(n) for n in args.nodes.split(",") if n.strip()]
    s, e = Setup(), Emulation(tokens=args.tokens, steps=args.steps)
    measured = emulated(counts, node_counts, e) if node_counts else []
    records = measured + projected(s)
    print(*([emulation_table(measured, e)] if measured else []), distinct_table(s, counts),
          projection_table(s, records), "\n".join(goal_check(s)), sep="\n\n")
    if args.json:
        try:
            args.json.write_text(json.dumps(records, indent=1) + "\n")
        except OSError as err:
            raise SystemExit(f"row_sync.py: cannot write {args.json} ({err.strerror}); pass another --json PATH")
        print(f"\nwrote {len(records)} records to {args.json}")


if __name__ == "__main__":
    main(sys.argv[1:])
