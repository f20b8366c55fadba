"""CPU Adam of the host tables on the step's critical path: serial vs next-use first, side by side.

The store's real step (one process, this machine's CPU Adam kernel) with token ids drawn from the 128k
vocabulary's counts, lazy and dense (the recipe's) AdamW, with ``host_tables.overlap_update`` off (every row
before the next step's rows are released) and on (the rows the next step reads first; the rest on a
background thread), and with a working set of ``--resident`` rows a layer (``host_tables.resident_rows``: the step's
rows updated where the step runs). Between steps the training thread sleeps for ``--device-step`` seconds: on a
GPU node the device runs forward and backward then and the host's cores are free, which is what the
background part needs. Per step it prints, as medians over alternating runs: the seconds the step's end
(``RowPipeline.step``) held the training thread (the critical path), the seconds of CPU Adam moved beside the next step, the
seconds the next step waited for them, and the share of updated rows that were not read next. For the working
set, ``held`` splits into the slots' AdamW (``update s``: on a GPU a device kernel of ~4-12 ms by
docs/gpu_step_v2.md, here DeepSpeed's kernel on these cores) and the host's part (``host s``: admitting the next
step's rows, the dense decay of entering rows): what would stay on the path on a GPU. During the "device step" the
prefetch thread loads the step after's entering rows into the working set ahead (``OwnerTier.plan_ahead``,
``preload``; with dense Adam once their decay of the step is done, asked first: ``LaterDecay``), in ``ahead s`` (of
the device step: past it, the prefetch thread would be late); ``at end`` counts the rows that still entered at the
step's end, on the path, and ``staged`` those of them whose state that thread gathered ahead (``StagedRows``: only
their put in place is left). ``--nodes N``
runs N processes as N emulated nodes (one DP rank each, ``--tokens`` each; rank 0's figures): the host step then
also pulls the rows other nodes updated, and a working set holds the rows its rank owns and sends them back to the
ranks that read them; ``MB sent`` is what rank 0 sent a step (row gradients, rows, ids); ``back s``, of ``host s``,
the working set's rows sent back from their owners (``OwnerTier._receive``).

Run: ``.venv/bin/python benchmarks/update_order.py [--tokens 32768] [--cols 512] [--layers 2]
[--device-step 0.5] [--steps 6] [--repeats 2] [--resident 16384] [--nodes 1]`` (about two minutes on 2 CPU cores; host
memory ~12 x V x cols x layers bytes a node, and as much again for the working set).
"""

from __future__ import annotations

import argparse
import gc
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

from benchmarks.row_sync import DEFAULT_COUNTS, backward_one_step, load_counts, token_batches  # noqa: E402


def _run(rank: int, port: int, p: np.ndarray, args, plans: list[tuple[str, bool, int]], out: str) -> None:
    """Each plan (optimizer, overlap, working-set rows) in turn, in this process (emulated node ``rank``): its store's
    steps timed; rank 0 keeps its records."""
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(args.nodes), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GROUP_RANK=str(rank))  # GROUP_RANK: torchrun's node number
    if args.nodes > 1:
        torch.set_num_threads(max(1, os.cpu_count() // args.nodes))
    from stem_megatron import parallel

    parallel.initialize(1, 1, 0)
    try:
        results = [_steps(p, args, rank, *plan) for plan in plans]
    finally:
        parallel.destroy()
    if rank == 0:
        torch.save(results, os.path.join(out, "records.pt"))


def _steps(p: np.ndarray, args, rank: int, optimizer: str, overlap: bool, resident: int) -> list[dict]:
    from stem_megatron.config import HostTablesConfig
    from stem_megatron.host_tables.store import HostTableStore, StoreConfig

    def draw(step: int) -> torch.Tensor:
        rng = np.random.default_rng(step if args.nodes == 1 else [step, rank])
        return torch.from_numpy(rng.choice(len(p), size=args.tokens, p=p)).view(1, -1)

    host = HostTablesConfig(optimizer=optimizer, overlap_update=overlap, resident_rows=resident)
    store = HostTableStore(StoreConfig(tuple(range(1, args.layers + 1)), len(p), args.cols, init_std=0.02, seed=0,
                                       host=host))
    state = store.record.state
    for layer in store.layers:  # the moments' tmpfs pages touched now, as in a run that has trained a while:
        state.exp_avg[layer].zero_()  # else each step faults in the new rows' pages and times the kernel
        state.exp_avg_sq[layer].zero_()
    records = []
    with store.stream(token_batches(draw, args.steps), 1) as rows:
        for _ in range(args.steps):
            backward_one_step(rows, store, device_step=args.device_step)  # the prefetch thread works ahead meanwhile
            start = time.perf_counter()
            rows.step(1e-3)
            held = time.perf_counter() - start
            stats = store.take_stats()
            records.append(dict(held=held, later=stats["stem_rows_updated_later"],
                                rows=stats["stem_node_rows_updated"], beside=stats["stem_cpu_adam_overlapped_s"],
                                wait=stats["stem_adam_wait_s"], update=stats.get("stem_resident_update_s", 0.0),
                                entered=stats.get("stem_rows_entered", 0) - stats.get("stem_rows_entered_ahead", 0),
                                staged=stats.get("stem_rows_entered_staged", 0), sent=stats["stem_bytes_sent"],
                                back=stats.get("stem_receive_s", 0.0), ahead=stats.get("stem_ahead_s", 0.0)))
    store.settle()
    del store
    gc.collect()  # its tables (tmpfs) go before the next plan's are made
    return records[1:]  # the first step builds and warms the kernel


def measure(p: np.ndarray, args, plans: list[tuple[str, bool, int]]) -> list[list[dict]]:
    """Each plan's step records, all plans in one process (one start-up of torch, megatron and the kernel)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_run, args=(get_free_port(), p, args, plans, tmp), nprocs=args.nodes, join=True)
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
    parser.add_argument("--resident", type=int, default=16384, help="working-set rows a layer (0: no such arm)")
    parser.add_argument("--nodes", type=int, default=1, help="emulated nodes, a DP rank each")
    args = parser.parse_args(argv)
    counts = load_counts(args.counts)
    p = counts / counts.sum()
    print(f"CPU Adam on the critical path: V={len(p):,}, {args.tokens:,} tokens a step from {args.counts.name}, "
          f"{args.layers} layers x {args.cols} columns, {torch.get_num_threads()} OpenMP threads, device step "
          f"{args.device_step} s, {args.nodes} node(s); medians of {args.repeats} x {args.steps - 1} steps")
    print(f"{'optimizer':9} {'order':16} {'held s':>8} {'vs serial':>9} {'beside s':>9} {'wait s':>7} "
          f"{'rows/step':>10} {'not read next':>13} {'MB sent':>8} {'update s':>9} {'host s':>7} {'back s':>7} "
          f"{'at end':>8} {'staged':>7} {'ahead s':>8}")
    arms = {"serial": (False, 0), "next-use first": (True, 0)}
    if args.resident:
        arms["working set"] = (True, args.resident)
    plans = [(optimizer, overlap, resident) for optimizer in ("lazy", "dense") for overlap, resident in arms.values()]
    runs = {plan: [] for plan in plans}
    for _ in range(args.repeats):  # alternating: the machine's noise falls on all
        for plan, records in zip(plans, measure(p, args, plans)):
            runs[plan] += records
    for optimizer in ("lazy", "dense"):
        runs_of = {arm: runs[(optimizer, *plan)] for arm, plan in arms.items()}
        serial = statistics.median(r["held"] for r in runs_of["serial"])
        for arm, records in runs_of.items():
            held = statistics.median(r["held"] for r in records)
            rows = statistics.median(r["rows"] for r in records)
            later = statistics.median(r["later"] / r["rows"] for r in records)
            resident = arms[arm][1] > 0
            split = (f" {statistics.median(r['update'] for r in records):9.3f} "
                     f"{statistics.median(r['held'] - r['update'] for r in records):7.3f} "
                     f"{statistics.median(r['back'] for r in records):7.3f} "
                     f"{statistics.median(r['entered'] for r in records):8,.0f} "
                     f"{statistics.median(r['staged'] for r in records):7,.0f} "
                     f"{statistics.median(r['ahead'] for r in records):8.3f}") if resident else ""
            print(f"{optimizer:9} {arm:16} {held:8.3f} {held / serial:8.2f}x "
                  f"{statistics.median(r['beside'] for r in records):9.3f} "
                  f"{statistics.median(r['wait'] for r in records):7.3f} {rows:10,.0f} {later:12.0%} "
                  f"{statistics.median(r['sent'] for r in records) / 1e6:8.1f}{split}")


if __name__ == "__main__":
    main()
