"""Every tensor of a checkpoint checked finite before anything of it is written: a NaN or inf in the weights, the
optimizer's state or the host tables and their moments would be resumed from and trained on, so such a checkpoint is
never sealed and never ``latest``; the save fails in one line naming the tensors, and the last good checkpoint stays.

Each rank checks what it writes, megatron's main replicas (every saved value once, so the world reads the checkpoint's
bytes once between them). A tensor's sum is NaN or inf when any value is, so a finite sum clears the tensor in one read
at memory speed with no temporary: a 128256 x 8192 fp32 table (4.2 GB) in 0.1 s on 2 CPU cores, where
``torch.isfinite(x).all()`` (a bool copy) ran at 0.5 GB/s. A sum that is not finite (a bad value, or a sum past the
float range) is settled by the tensor's least and greatest values (``aminmax`` propagates NaN).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, is_main_replica

from stem_megatron.checkpoint.atomic import LATEST, CheckpointError, latest_name


def written(state: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The floating-point tensors this rank writes of a sharded state dict, by their checkpoint keys."""
    for value in nested_values(state):
        if (isinstance(value, (ShardedTensor, ShardedTensorFactory)) and is_main_replica(value.replica_id)
                and torch.is_tensor(value.data) and value.data.is_floating_point()):
            yield value.key, value.data


def nonfinite(tensors: list[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the tensors that hold a NaN or an inf."""
    if not tensors:
        return []
    sums = torch.stack([t.sum(dtype=torch.float32).cpu() for _, t in tensors])
    return [name for (name, t), ok in zip(tensors, torch.isfinite(sums).tolist())
            if not ok and not torch.isfinite(torch.stack(torch.aminmax(t))).all()]


def check(states: list[dict], step: int, root: Path) -> int:
    """Refuse the checkpoint after ``step`` if any rank's part of ``states`` (sharded state dicts) holds a NaN or an
    inf; else the bytes of those tensors over the world, the checkpoint's size (collective)."""
    tensors = [named for state in states for named in written(state)]
    mine = (nonfinite(tensors), sum(t.numel() * t.element_size() for _, t in tensors))
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    bad = sorted({name for names, _ in parts for name in names})
    if bad:
        latest = latest_name(root)
        keeps = (f"{root / LATEST} stays {latest}: resume from it (checkpoint.load={root / latest}) with a lower "
                 f"train.lr, or skip the batches that broke it (train.skip_steps)" if latest else
                 "no earlier checkpoint exists: start again with a lower train.lr")
        raise CheckpointError(f"checkpoint after step {step} not saved: {len(bad)} tensor(s) hold NaN or inf ("
                              f"{', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); {keeps}")
    return sum(size for _, size in parts)
