"""STEM tables and their Adam moments (host store) in a checkpoint, through megatron-core dist-checkpointing and the
optimizer chain's tables member (``training/table_optimizer.TableOptimizer``; a run without host tables has none, and
its checkpoint no ``stem/``).

The store keeps rows in the ownership permutation's order (``ownership.RowOwnership``), and so does the
checkpoint: per layer one global ``V x d_ff`` tensor per kind, ``stem.L<layer>.weight.by_owner`` (the fp32
master rows), ``.exp_avg.by_owner`` and ``.exp_avg_sq.by_owner``, row p holding token id ``ids_at(p)``. Each
node writes its contiguous range of rows (its first DP peer: the peers share the node's memory), each TP
rank its column block. On load every rank asks for what its own layout needs: its node's range of master
rows and moments and, with fp32 copies, the whole table straight into the node's copy (bf16 copies are
filled from the owners instead: ``HostTableStore.restore``). megatron reshards: a run resumes under
another TP, PP, DP size or node count. A resume sets the Adam step count (the member's ``state_dict``) to the train
state's step.

The kinds are stored in the run's ``table_state.StateSpec`` (bf16 masters or moments, a row-wise second moment of
``V x blocks``), which ``state.json`` records; a run of another spec loads them into tensors of the checkpoint's and
converts them once (``HostRecord.take_loaded``; docs/checkpoints.md), saying so in one line. A checkpoint without
``state.json`` holds fp32 state.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.validation import StrictHandling

from stem_megatron.checkpoint.atomic import CheckpointError
from stem_megatron.durable import write_synced
from stem_megatron.host_tables.store import CHECKPOINT_KINDS
from stem_megatron.table_state import StateSpec

SPEC = "state.json"  # the checkpoint's StateSpec, beside megatron's files in stem/


def state(tables) -> dict:
    """This node's master rows and moments of this stage, as ``save`` writes them, the last step's updates done;
    ``tables``: the optimizer chain's member (``FiniteChain.tables``)."""
    return tables.sharded_state_dict()


def save(tables, sharded: dict, directory: Path) -> None:
    """Write ``state``'s rows (collective over the world); a run without host tables writes no ``stem/``."""
    if not tables.hosted:
        return
    Path(directory).mkdir(exist_ok=True)
    dist_checkpointing.save(sharded, str(directory))
    if dist.get_rank() == 0:
        write_synced(Path(directory) / SPEC, json.dumps(dataclasses.asdict(tables.store.record.spec)))


def saved_spec(directory: Path) -> StateSpec:
    """The ``StateSpec`` a checkpoint's tables are stored in (fp32 where it records none)."""
    path = Path(directory) / SPEC
    return StateSpec(**json.loads(path.read_text())) if path.exists() else StateSpec()


def load(tables, directory: Path, kinds: tuple[str, ...] = CHECKPOINT_KINDS,
         steps_done: Optional[int] = None) -> None:
    """Fill the node-shared tables of this stage from a checkpoint, resharded to this run's layout
    (collective over the world); ``kinds=("weight",)`` takes only the tables (a new run keeps its fresh,
    zero Adam moments); ``steps_done``: resuming, the Adam step count to continue from. The first DP peer of each
    node loads straight into the shared memory; the other ranks of the node read nothing. Without host tables:
    nothing."""
    if not tables.hosted:
        return
    record, saved = tables.store.record, saved_spec(directory)
    if saved != record.spec and dist.get_rank() == 0:
        print(f"stem tables: {directory} holds {_named(saved)} state, converted once to this run's "
              f"{_named(record.spec)} (docs/checkpoints.md)", file=sys.stderr, flush=True)
    record.expect(saved)
    wanted = tables.sharded_state_dict(is_loading=True, kinds=kinds)
    try:
        loaded = dist_checkpointing.load(wanted, str(directory), strict=StrictHandling.LOG_UNEXPECTED)
    except Exception as error:  # megatron reports a missing layer or a shape mismatch in its own terms
        raise CheckpointError(f"{directory}: the STEM tables of layers {tables.store.layers} ({', '.join(kinds)}) do "
                              f"not load ({type(error).__name__}: {error}); resume with the checkpoint's STEM layer "
                              f"plan, model.vocab_size and model.ffn_hidden_size") from error
    for key, sharded in wanted.items():
        sharded.data.copy_(loaded[key])  # a no-op where megatron loaded in place
    record.take_loaded()
    tables.load_state_dict({} if steps_done is None else {"steps_done": steps_done})


def _named(spec: StateSpec) -> str:
    return f"state_dtype={spec.state_dtype} second_moment={spec.second_moment} master_dtype={spec.master_dtype}"
