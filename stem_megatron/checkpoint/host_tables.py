"""STEM tables and their Adam moments (host store) in a checkpoint, through megatron-core dist-checkpointing.

The store keeps rows in the ownership permutation's order (``ownership.RowOwnership``), and so does the
checkpoint: per layer one global ``V x d_ff`` tensor per kind, ``stem.L<layer>.weight.by_owner`` (the fp32
master rows), ``.exp_avg.by_owner`` and ``.exp_avg_sq.by_owner``, row p holding token id ``ids_at(p)``. Each
node writes its contiguous range of rows (its first DP peer: the peers share the node's memory), each TP
rank its column block. On load every rank asks for what its own layout needs: its node's range of master
rows and moments and, with fp32 copies, the whole table straight into the node's copy (bf16 copies are
filled from the owners instead: ``store.copies_from_masters``). megatron reshards: a run resumes under
another TP, PP, DP size or node count. The Adam step count is ``steps_done`` (train state).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.validation import StrictHandling

from stem_megatron.checkpoint.atomic import CheckpointError
from stem_megatron.host_tables.store import HostTableStore

KINDS = ("weight", "exp_avg", "exp_avg_sq")


def _sharded(store: HostTableStore, kinds: tuple[str, ...], loading: bool) -> dict:
    """``{key: ShardedTensor}``: this node's range of each kind (the master rows for ``weight``), and for
    loading into fp32 copies the whole table instead of the master range."""
    out = {}
    for layer in store.layers:
        for kind in kinds:
            if kind == "weight" and loading and store.read_dtype == torch.float32:
                block, row = store.weight[layer], 0  # the node's copy, every row (its master range included)
            else:
                block, row = (store.master if kind == "weight" else getattr(store, kind))[layer], store.own.lo
            out[f"L{layer}.{kind}"] = ShardedTensor(
                f"stem.L{layer}.{kind}.by_owner", block, block.dtype, tuple(block.shape),
                (store.vocab_size, store.d_ff), (row, store.tp_rank * store.cols),
                axis_fragmentations=None, replica_id=store.node.peer_index)  # uneven ranges: DCP reshards
    return out


def save(store: HostTableStore, directory: Path) -> None:
    """Write this stage's master rows and moments (collective over the world)."""
    Path(directory).mkdir(exist_ok=True)
    store.settle()
    dist_checkpointing.save(_sharded(store, KINDS, loading=False), str(directory))


def load(store: HostTableStore, directory: Path, kinds: tuple[str, ...] = KINDS) -> None:
    """Fill the node-shared tables of this stage from a checkpoint, resharded to this run's layout
    (collective over the world); ``kinds=("weight",)`` takes only the tables (a new run keeps its fresh,
    zero Adam moments). The first DP peer of each node loads straight into the shared memory; the
    other ranks of the node read nothing."""
    wanted = _sharded(store, kinds, loading=True) if store.node.peer_index == 0 else {}
    try:
        loaded = dist_checkpointing.load(wanted, str(directory), strict=StrictHandling.LOG_UNEXPECTED)
    except Exception as error:  # megatron reports a missing layer or a shape mismatch in its own terms
        raise CheckpointError(f"{directory}: the STEM tables of layers {store.layers} ({', '.join(kinds)}) do not load "
                              f"({type(error).__name__}: {error}); resume with the checkpoint's STEM layer plan, "
                              f"model.vocab_size and model.ffn_hidden_size") from error
    for key, sharded in wanted.items():
        sharded.data.copy_(loaded[key])  # a no-op where megatron loaded in place
    dist.barrier(store.node.group)
    store.copies_from_masters()
