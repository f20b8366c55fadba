"""STEM tables and their Adam moments (host store) in a checkpoint, through megatron-core dist-checkpointing.

Each table is one global ``V x d_ff`` tensor ``stem.L<layer>.weight`` in token-id order; a TP rank contributes
its column block ``[V, d_ff/tp]`` (offset ``tp_rank`` along d_ff), written by DP rank 0 after its node's copy
was made current (``store.make_current``). The moments exist only at each row's owner node, so they are
saved in the ownership permutation's order (``ownership.RowOwnership``), ``stem.L<layer>.exp_avg.by_owner``
and ``.exp_avg_sq.by_owner``: each node writes its contiguous range of rows (its first DP peer; the
peers share the node's memory). On load every rank asks for what its own layout needs (the whole table on
every node, the moments of the node's new range), so megatron reshards: a run resumes under another TP,
PP, DP size or node count. The Adam step count is ``steps_done`` (train state).
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.validation import StrictHandling

from stem_megatron.checkpoint.atomic import CheckpointError
from stem_megatron.host_tables.store import MOMENTS, HostTableStore

KINDS = ("weight", *MOMENTS)


def _sharded(store: HostTableStore, kinds: tuple[str, ...]) -> dict:
    """``{key: ShardedTensor}`` of this rank's table blocks and its node's moment rows."""
    out = {}
    for layer in store.layers:
        if "weight" in kinds:
            out[f"L{layer}.weight"] = ShardedTensor.from_rank_offsets(
                f"stem.L{layer}.weight", store.weight[layer], (1, store.tp_rank, store.tp),
                replica_id=parallel_state.get_data_parallel_rank())
        for kind in (k for k in kinds if k in MOMENTS):
            block = getattr(store, kind)[layer]
            out[f"L{layer}.{kind}"] = ShardedTensor(
                f"stem.L{layer}.{kind}.by_owner", block, block.dtype, tuple(block.shape),
                (store.vocab_size, store.d_ff), (store.own.lo, store.tp_rank * store.cols),
                axis_fragmentations=None, replica_id=store.node.peer_index)  # uneven ranges: DCP reshards
    return out


def save(store: HostTableStore, directory: Path) -> None:
    """Write this stage's tables and moments (collective over the world)."""
    store.make_current(everywhere=False)
    Path(directory).mkdir(exist_ok=True)
    dist_checkpointing.save(_sharded(store, KINDS), str(directory))


def load(store: HostTableStore, directory: Path, kinds: tuple[str, ...] = KINDS) -> None:
    """Fill the node-shared tables of this stage from a checkpoint, resharded to this run's layout
    (collective over the world); ``kinds=("weight",)`` takes only the tables (a new run keeps its fresh,
    zero Adam moments). The first DP peer of each node loads straight into the shared memory; the
    other ranks of the node read nothing."""
    mine = store.node.peer_index == 0
    wanted = _sharded(store, kinds) if mine else {}
    try:
        loaded = dist_checkpointing.load(wanted, str(directory), strict=StrictHandling.LOG_UNEXPECTED)
    except Exception as error:  # megatron reports a missing layer or a shape mismatch in its own terms
        raise CheckpointError(f"{directory}: the STEM tables of layers {store.layers} ({', '.join(kinds)}) do not load "
                              f"({type(error).__name__}: {error}); resume with the checkpoint's STEM layer plan, "
                              f"model.vocab_size and model.ffn_hidden_size") from error
    for key, sharded in wanted.items():
        sharded.data.copy_(loaded[key])  # a no-op where megatron loaded in place
    dist.barrier(store.node.group)
