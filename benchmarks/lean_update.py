"""The row update's time per row for each table state setting, side by side with fp32 AdamW, against a memcpy.

At 1B's width (``--cols`` 8,192 columns, a rank's whole row at TP 1), ``--tokens`` tokens a step drawn from the 128k
vocabulary's counts (``benchmarks/data/token_counts_128k.npy``, as ``update_order.py``); their distinct ids placed
in a table of ``--rows`` rows (the id's share of the vocabulary: every setting's table at V rows would take ~38 GB).
Per setting (``row_state.StateSpec``; fp32 is DeepSpeed's kernel, every other the lean kernel,
``csrc/lean_adam.cpp``), one process, every table kept, the settings in turn in each of ``--repeats`` rounds:

- lazy: the touched rows, with their gradients (``RowOptimizer.update``);
- dense: every row of the table, the untouched ones with zero gradients (the recipe's dense Adam);

as µs per row (medians over rounds), fp32's time over the setting's (the median of the ratios within a round), the
bytes an update moves per parameter (each kind read and written, the fp32 gradient read: ``StateSpec.moved_bytes``)
and that traffic in GB/s against a memcpy's (read + write) timed in each round.

Run: ``.venv/bin/python benchmarks/lean_update.py [--tokens 32768] [--cols 8192] [--rows 16384] [--repeats 7]
[--threads N] [--cpu-time]``
(about a minute on 2 CPU cores; host memory 36 B x rows x cols for the five tables, 4.8 GB by default).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's stem_megatron, installed or not
from stem_megatron.setup_check import require_environment  # noqa: E402

require_environment()  # before torch: another Python gets `make setup`, not a traceback

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.row_sync import DEFAULT_COUNTS, load_counts  # noqa: E402
from stem_megatron.host_tables.row_optimizer import RowAdam, RowOptimizer  # noqa: E402
from stem_megatron.host_tables.row_state import RowState, StateSpec  # noqa: E402

SETTINGS = {
    "fp32": StateSpec(),
    "bf16 moments": StateSpec("bf16", "element", "fp32"),
    "bf16 moments, bf16 master": StateSpec("bf16", "element", "bf16"),
    "row-wise v, bf16 m": StateSpec("bf16", "row", "fp32"),
    "lean (bf16, row, bf16)": StateSpec("bf16", "row", "bf16"),
}
CPU = torch.device("cpu")


def table_rows(p: np.ndarray, tokens: int, rows: int, seed: int = 0) -> torch.Tensor:
    """A step's distinct ids drawn from ``p``, placed among ``rows`` table rows by their share of the vocabulary."""
    ids = np.unique(np.random.default_rng(seed).choice(len(p), size=tokens, p=p))
    return torch.from_numpy(np.unique(ids * rows // len(p)))


def timed(fn, clock=time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


def filled(spec: StateSpec, rows: int, cols: int) -> RowState:
    """A table in ``spec``'s dtypes whose pages are touched now, not inside a timed update."""
    state = RowState.zeros([1], rows, cols, CPU, spec)
    for tensor in state.of(1):
        tensor.fill_(0.01)
    return state


def one_round(adam: RowAdam, spec: StateSpec, state: RowState, ids: torch.Tensor, rest: torch.Tensor,
              grads: torch.Tensor, step: int, clock) -> tuple[float, float]:
    """(lazy seconds, dense seconds) of one setting."""
    lazy, dense = (RowOptimizer(adam, "rows", CPU, dense=d, spec=spec) for d in (False, True))
    lazy_s = timed(lambda: lazy.update(step, 1e-3, state, 1, ids, grads), clock)
    dense_s = timed(lambda: dense.update(step + 1, 1e-3, state, 1, ids, grads, untouched=rest), clock)
    return lazy_s, dense_s


def memcpy_rate(clock, nbytes: int = 1 << 29) -> float:
    """GB/s of a memcpy (bytes read + written), median of 5."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    return 2 * nbytes / statistics.median(timed(lambda: dst.copy_(src), clock) for _ in range(5)) / 1e9


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", type=Path, default=DEFAULT_COUNTS, help="per-id token counts (.npy)")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens per step (the paper's batch)")
    parser.add_argument("--cols", type=int, default=8192, help="columns of U_l per rank (d_ff / TP)")
    parser.add_argument("--rows", type=int, default=16384, help="rows of the table")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, help="OpenMP threads of the kernels (default: torch's)")
    parser.add_argument("--cpu-time", action="store_true", help="time by this thread's CPU time: with --threads 1, "
                        "the kernels' own time, without the waits of a machine other jobs share")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    counts = load_counts(args.counts)
    ids = table_rows(counts / counts.sum(), args.tokens, args.rows)
    grads = torch.randn(ids.numel(), args.cols, generator=torch.Generator().manual_seed(0)) * 1e-3
    adam = RowAdam((0.9, 0.95), 1e-8, 0.1)
    states = {name: filled(spec, args.rows, args.cols) for name, spec in SETTINGS.items()}
    rest = torch.from_numpy(np.setdiff1d(np.arange(args.rows), ids.numpy()))
    times = {name: ([], []) for name in SETTINGS}
    copies = []
    for r in range(-1, args.repeats):  # rounds (the first a warm-up): the machine's noise falls on every setting
        copies.append(memcpy_rate(clock))
        for name, spec in SETTINGS.items():
            lazy_s, dense_s = one_round(adam, spec, states[name], ids, rest, grads, 3 + 2 * r, clock)
            if r < 0:
                continue
            times[name][0].append(lazy_s)
            times[name][1].append(dense_s)
    memcpy = statistics.median(copies)
    print(f"Row update at {args.cols:,} columns: {ids.numel():,} touched rows ({args.tokens:,} tokens from "
          f"{args.counts.name}) of a {args.rows:,}-row table, {torch.get_num_threads()} OpenMP threads; medians of "
          f"{args.repeats} rounds{', CPU time' if args.cpu_time else ''}; memcpy {memcpy:.1f} GB/s (read + write)")
    print(f"{'setting':27} {'stored B':>8} | {'lazy µs/row':>11} {'x fp32':>6} {'B moved':>7} {'GB/s':>5} "
          f"{'memcpy':>6} | {'dense µs/row':>12} {'x fp32':>6} {'B moved':>7} {'GB/s':>5} {'memcpy':>6}")
    fp32 = times["fp32"]
    for name, spec in SETTINGS.items():
        lazy_s, dense_s = (statistics.median(t) for t in times[name])
        lazy_row, dense_row = lazy_s / ids.numel() * 1e6, dense_s / args.rows * 1e6
        lazy_x, dense_x = (statistics.median(b / t for b, t in zip(fp32[k], times[name][k])) for k in (0, 1))
        lazy_b = spec.moved_bytes(args.cols)
        dense_b = (ids.numel() * lazy_b + (args.rows - ids.numel()) * spec.moved_bytes(args.cols, False)) / args.rows
        lazy_rate = lazy_b * args.cols / lazy_row / 1e3
        dense_rate = dense_b * args.cols / dense_row / 1e3
        print(f"{name:27} {spec.stored_bytes(args.cols):8.2f} | {lazy_row:11.2f} {lazy_x:5.2f}x "
              f"{lazy_b:7.2f} {lazy_rate:5.1f} {lazy_rate / memcpy:6.0%} | {dense_row:12.2f} "
              f"{dense_x:5.2f}x {dense_b:7.2f} {dense_rate:5.1f} {dense_rate / memcpy:6.0%}")


if __name__ == "__main__":
    main()
