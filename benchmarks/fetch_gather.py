"""A micro-batch's rows gathered into pinned staging, narrowed to the compute dtype: two ways.

On GPU a fetch gathers ``U_l[unique ids, my columns]`` from the fp32 host table into its staging slot in bf16
(``transfer.Transfer.gather``): the rows pass through a few MB of scratch the fetching thread reuses. The baseline,
``staged.copy_(table.index_select(0, ids))``, makes a pageable fp32 temporary of the whole micro-batch's rows per
layer, faulted in and zeroed by the kernel each time, then cast. Both run here side by side (rounds
interleaved, medians), on one thread (a prefetch thread under torchrun with 8 ranks on one node) and on all
of this machine's, with ids drawn from the 128k-vocabulary profile at the 1B micro-batch (4,096 tokens) by default.
The destination stands in for pinned staging (plain memory here; pinning changes neither path's host work).

Run: ``.venv/bin/python benchmarks/fetch_gather.py [--tokens 4096] [--cols 8192] [--rounds 7]`` (one fp32 table
of 129,280 x cols: 4.2 GB at 8192).
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
from stem_megatron.host_tables.transfer import HostToDevice  # noqa: E402


class _HostCopies:
    """Copies that stay on the host: ``Transfer.gather``'s host work alone, as on a GPU node before the copy."""

    @staticmethod
    def pinned(nbytes):
        return torch.empty(nbytes, dtype=torch.uint8)

    @staticmethod
    def stream():
        import contextlib

        return contextlib.nullcontext()

    @staticmethod
    def to_device(host):
        return host

    @staticmethod
    def record():
        return None


def _before(table: torch.Tensor, ids: torch.Tensor, staged: torch.Tensor) -> None:
    staged.copy_(table.index_select(0, ids))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of a micro-batch (1B: 4,096; 350M: 8,192)")
    ap.add_argument("--cols", type=int, default=8192, help="columns of a table (d_ff / TP)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--counts", type=Path, default=DEFAULT_COUNTS)
    args = ap.parse_args(argv)
    counts = load_counts(args.counts)
    p = counts / counts.sum()
    table = torch.randn(len(p), args.cols)
    rng = np.random.default_rng(0)
    h2d = HostToDevice(torch.device("cpu"), dtype=torch.bfloat16, slot_bytes=0, copies=_HostCopies())
    print(f"V={len(p):,}, {args.cols} columns, micro-batches of {args.tokens:,} tokens from the 128k profile; "
          f"ms per layer (median of {args.rounds}), fp32 table -> bf16 staging")
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        times = {"before": [], "after": []}
        for _ in range(args.rounds):
            ids = torch.from_numpy(np.unique(rng.choice(len(p), size=args.tokens, p=p)))
            staged = torch.empty(ids.numel(), args.cols, dtype=torch.bfloat16)
            start = time.perf_counter()
            _before(table, ids, staged)
            times["before"].append(time.perf_counter() - start)
            with h2d.transfer() as send:
                start = time.perf_counter()
                after = send.gather(table, ids)
                times["after"].append(time.perf_counter() - start)
            if not torch.equal(after, staged):
                raise SystemExit("the two gathers differ")
        before, after = (statistics.median(times[k]) * 1e3 for k in ("before", "after"))
        print(f"{threads} thread(s), {ids.numel():,} rows: before {before:.1f} ms, after {after:.1f} ms, "
              f"after/before {after / before:.2f}")


if __name__ == "__main__":
    main()
