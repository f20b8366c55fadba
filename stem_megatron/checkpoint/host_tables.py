"""STEM tables and their Adam moments (host store) in a checkpoint, through megatron-core dist-checkpointing.

Each (layer, kind) is one global ``V x d_ff`` tensor ``L<layer>.<kind>``, kind in weight / exp_avg /
exp_avg_sq. A TP rank contributes its column block ``[V, d_ff/tp]`` as a ``ShardedTensor`` (offset ``tp_rank``
along d_ff); DP replicas hold identical copies, so only DP rank 0 of each (pipeline stage, TP rank) writes.
On load every rank asks for the block its own layout needs, so megatron reshards: a run resumes under
another TP, PP, DP size or node count. The first DP peer of each node writes the block into the
node-shared memory. The Adam step count is ``steps_done`` (train state).
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.validation import StrictHandling

from stem_megatron.checkpoint.atomic import CheckpointError
from stem_megatron.host_tables.store import HostTableStore

KINDS = ("weight", "exp_avg", "exp_avg_sq")


def _sharded(store: HostTableStore, kinds: tuple[str, ...], blocks: dict) -> dict:
    """``{key: ShardedTensor}`` of this rank's column blocks (``blocks[layer, kind]``: the local data)."""
    replica = parallel_state.get_data_parallel_rank()
    return {f"L{layer}.{kind}": ShardedTensor.from_rank_offsets(
                f"stem.L{layer}.{kind}", blocks[layer, kind], (1, store.tp_rank, store.tp), replica_id=replica)
            for layer in store.layers for kind in kinds}


def save(store: HostTableStore, directory: Path) -> None:
    """Write this stage's table blocks (collective over the world)."""
    blocks = {(layer, kind): getattr(store, kind)[layer] for layer in store.layers for kind in KINDS}
    Path(directory).mkdir(exist_ok=True)
    dist_checkpointing.save(_sharded(store, KINDS, blocks), str(directory))


def load(store: HostTableStore, directory: Path, kinds: tuple[str, ...] = KINDS) -> None:
    """Fill the node-shared tables of this stage from a checkpoint, resharded to this run's TP size
    (collective over the world); ``kinds=("weight",)`` takes only the tables (a new run keeps its fresh,
    zero Adam moments). The first DP peer of each node loads straight into the shared memory; the
    other ranks of the node read nothing."""
    mine = store.node.peer_index == 0
    blocks = {(layer, kind): getattr(store, kind)[layer] for layer in store.layers for kind in kinds}
    try:
        loaded = dist_checkpointing.load(_sharded(store, kinds, blocks) if mine else {}, str(directory),
                                         strict=StrictHandling.LOG_UNEXPECTED)
    except Exception as error:  # megatron reports a missing layer or a shape mismatch in its own terms
        raise CheckpointError(f"{directory}: the STEM tables of layers {store.layers} ({', '.join(kinds)}) do not load "
                              f"({type(error).__name__}: {error}); resume with the checkpoint's STEM layer plan, "
                              f"model.vocab_size and model.ffn_hidden_size") from error
    for (layer, kind), block in blocks.items() if mine else ():
        block.copy_(loaded[f"L{layer}.{kind}"])  # a no-op where megatron loaded in place
    dist.barrier(store.node.group)
