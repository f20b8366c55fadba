"""CPU Adam of the host tables on the step's critical path: serial vs next-use first, side by side.

The store's real step (one process, this machine's CPU Adam kernel) with token ids drawn from the 128k
vocabulary's counts, lazy and dense (the recipe's) AdamW, with ``stem.overlap_update`` off (every row
before the next step's rows are released) and on (the rows the next step reads first; the rest on a
background thread). Between steps the training thread sleeps for ``--device-step`` seconds: on a GPU
node the device runs forward and backward then and the host's cores are free, which is what the
background part needs. Per step it prints, as medians over alternating runs: the seconds ``store.step``
held the training thread (the critical path), the seconds of CPU Adam moved beside the next step, the
seconds the next step waited for them, and the share of updated rows that were not read next.

Run: ``.venv/bin/python benchmarks/update_order.py [--tokens 32768] [--cols 512] [--layers 2]
[--device-step 0.5] [--steps 6] [--repeats 2]`` (about two minutes on 2 CPU cores; host memory
~12 x V x cols x layers bytes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's stem_megatron, installed or not
from stem_megatron.setup_check import require_environment  # noqa: E402

require_environment()  # before torch and megatron: another Python gets `make setup`, not a traceback

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.distributed.elastic.utils.distributed import get_free_port  # noqa: E402

from benchmarks.row_sync import DEFAULT_COUNTS, backward_one_step, load_counts  # noqa: E402


def _run(rank: int, port: int, p: np.ndarray, args, optimizer: str, overlap: bool, out: str) -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      GROUP_RANK="0")
    from stem_megatron import parallel
    from stem_megatron.host_tables.store import HostTableStore

    def draw(step: int) -> torch.Tensor:
        return torch.from_numpy(np.random.default_rng(step).choice(len(p), size=args.tokens, p=p)).view(1, -1)

    parallel.initialize(1, 1, 0)
    try:
        store = HostTableStore(list(range(1, args.layers + 1)), len(p), args.cols, init_std=0.02, seed=0,
                               optimizer=optimizer, overlap_update=overlap)
        for layer in store.layers:  # the moments' tmpfs pages touched now, as in a run that has trained a while:
            store.exp_avg[layer].zero_()  # else each step faults in the new rows' pages and times the kernel
            store.exp_avg_sq[layer].zero_()
        store.refresh(torch.unique(draw(1)))
        records = []
        for step in range(1, args.steps + 1):
            backward_one_step(store, draw(step))
            start = time.perf_counter()
            store.step(1e-3, torch.unique(draw(step + 1)))
            held = time.perf_counter() - start
            time.sleep(args.device_step)  # the device's forward and backward of the next step
            stats = store.take_stats()
            records.append(dict(held=held, later=stats["stem_rows_updated_later"],
                                rows=stats["stem_node_rows_updated"], beside=stats["stem_cpu_adam_overlapped_s"],
                                wait=stats["stem_adam_wait_s"]))
        store.settle()
    finally:
        parallel.destroy()
    torch.save(records[1:], os.path.join(out, "records.pt"))  # the first step builds and warms the kernel


def measure(p: np.ndarray, args, optimizer: str, overlap: bool) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_run, args=(get_free_port(), p, args, optimizer, overlap, tmp), nprocs=1, join=True)
        return torch.load(os.path.join(tmp, "records.pt"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", type=Path, default=DEFAULT_COUNTS, help="per-id token counts (.npy)")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens per step (the paper's batch)")
    parser.add_argument("--cols", type=int, default=512, help="columns of U_l per rank (d_ff / TP)")
    parser.add_argument("--layers", type=int, default=2, help="STEM layers on the rank")
    parser.add_argument("--device-step", type=float, default=0.5, help="seconds of the device's next step")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    counts = load_counts(args.counts)
    p = counts / counts.sum()
    print(f"CPU Adam on the critical path: V={len(p):,}, {args.tokens:,} tokens a step from {args.counts.name}, "
          f"{args.layers} layers x {args.cols} columns, {torch.get_num_threads()} OpenMP threads, device step "
          f"{args.device_step} s; medians of {args.repeats} x {args.steps - 1} steps")
    print(f"{'optimizer':9} {'order':16} {'held s':>8} {'vs serial':>9} {'beside s':>9} {'wait s':>7} "
          f"{'rows/step':>10} {'not read next':>13}")
    for optimizer in ("lazy", "dense"):
        runs = {False: [], True: []}
        for _ in range(args.repeats):
            for overlap in (False, True):  # alternating: the machine's noise falls on both
                runs[overlap] += measure(p, args, optimizer, overlap)
        serial = statistics.median(r["held"] for r in runs[False])
        for overlap, records in runs.items():
            held = statistics.median(r["held"] for r in records)
            rows = statistics.median(r["rows"] for r in records)
            later = statistics.median(r["later"] / r["rows"] for r in records)
            print(f"{optimizer:9} {'next-use first' if overlap else 'serial':16} {held:8.3f} {held / serial:8.2f}x "
                  f"{statistics.median(r['beside'] for r in records):9.3f} "
                  f"{statistics.median(r['wait'] for r in records):7.3f} {rows:10,.0f} {later:12.0%}")


if __name__ == "__main__":
    main()
