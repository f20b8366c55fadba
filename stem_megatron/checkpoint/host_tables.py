"""STEM tables and their Adam moments (host store) in a checkpoint.

One file per STEM layer and TP column slice, ``stem/L<layer>.tp<r>-of-<tp>.pt`` holding the
``[V, d_ff/tp]`` weight, ``exp_avg`` and ``exp_avg_sq`` blocks. The tables are identical on every DP
replica, so each file is written once: by the rank with DP index 0 of that (pipeline stage, TP rank).
Loading is done once per node (the first local DP peer writes into the node-shared memory), so it
does not depend on the DP size of either run. The Adam step count is ``steps_done`` (train state).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from stem_megatron.checkpoint.atomic import CheckpointError
from stem_megatron.host_tables.store import HostTableStore

KINDS = ("weight", "exp_avg", "exp_avg_sq")


def _path(directory: Path, layer: int, tp_rank: int, tp: int) -> Path:
    return Path(directory) / f"L{layer}.tp{tp_rank}-of-{tp}.pt"


def save(store: HostTableStore, directory: Path) -> None:
    """Write this stage's table slices (collective over the world only through the caller's barrier)."""
    if parallel_state.get_data_parallel_rank() != 0:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    for layer in store.layers:
        blocks = {kind: getattr(store, kind)[layer] for kind in KINDS}
        torch.save(blocks, _path(directory, layer, store.tp_rank, store.tp))


def load(store: HostTableStore, directory: Path, kinds: tuple[str, ...] = KINDS) -> None:
    """Fill the node-shared tables of this stage from a checkpoint (node collective); ``kinds=("weight",)``
    takes only the tables (a new run keeps its fresh, zero Adam moments)."""
    if store.node.peer_index == 0:
        for layer in store.layers:
            path = _path(directory, layer, store.tp_rank, store.tp)
            if not path.exists():
                found = sorted(p.name for p in Path(directory).glob(f"L{layer}.*.pt"))
                raise CheckpointError(
                    f"{path} is missing: the checkpoint has {found or 'no tables'} for STEM layer {layer}. "
                    f"Resume with the checkpoint's tensor_model_parallel_size and STEM layer plan")
            blocks = torch.load(path, map_location="cpu", weights_only=True)
            for kind in kinds:
                target = getattr(store, kind)[layer]
                if blocks[kind].shape != target.shape:
                    raise CheckpointError(f"{path}: {kind} has shape {tuple(blocks[kind].shape)}, this run "
                                          f"needs {tuple(target.shape)} (vocab_size x d_ff/tp)")
                target.copy_(blocks[kind])
    dist.barrier(store.node.group)
