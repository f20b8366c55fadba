"""Runs a test function in N real processes over gloo (torch.multiprocessing), megatron initialised.

Each worker gets ``(tp, pp)`` set up by ``stem_megatron.parallel.initialize`` and returns a picklable
result; the parent gets the list of results by rank. A worker exception fails the test with its
traceback.

Workers are forked from a forkserver that has imported torch, megatron-core and the training code once for the
whole session: a spawned worker would import them again (about 9 s of CPU each, four workers sharing two cores
in CI), which was most of every small multi-process test. The forkserver never runs a torch op, so no thread
pool is forked. A worker takes the test's environment as it is at the call (a forked worker would otherwise see
the server's, from its start) and seeds itself (``parallel.initialize``), as a spawned one did.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile

import torch
import torch.multiprocessing as mp
from torch.distributed.elastic.utils.distributed import get_free_port

multiprocessing.set_forkserver_preload(["torch", "megatron.core", "stem_megatron.training.loop", "stem_megatron.recipes"])


def _worker(rank, env, world, port, tp, pp, ep, seed, fn, args, out_dir):
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from stem_megatron import parallel

    parallel.initialize(tp, pp, seed, ep=ep)
    try:
        result = fn(*args)
    finally:
        parallel.destroy()
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))


def run(fn, world: int, *args, tp: int = 1, pp: int = 1, ep: int = 1, seed: int = 1234) -> list:
    """Run ``fn(*args)`` on ``world`` ranks with TP=tp, PP=pp, EP=ep (DP = world / (tp*pp))."""
    with tempfile.TemporaryDirectory() as out_dir:
        env = dict(os.environ)
        mp.start_processes(_worker, args=(env, world, get_free_port(), tp, pp, ep, seed, fn, args, out_dir),
                           nprocs=world, join=True, start_method="forkserver")
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world)]
