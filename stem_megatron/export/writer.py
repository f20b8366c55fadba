"""Export a trained run to the single-process format inference and evaluation load.

Every parameter is gathered over its tensor-parallel group into the full tensor and renamed to the
single-process name (global layer and expert indices, ``model.sharding``); host-resident tables
become the ``decoder.layers.<i>.mlp.U_l.weight`` parameters of a ``host_tables.placement=device`` model.
Owners (DP rank 0, expert-DP rank 0 for experts) write their parts to a scratch directory and rank 0
assembles the export, so no rank needs more memory than the final single-process model.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from stem_megatron.config import RunConfig
from stem_megatron.export.format import write_export
from stem_megatron.model.sharding import local_to_global
from stem_megatron.model.weights import current_weights


def _full(param: torch.Tensor) -> torch.Tensor:
    """Inverse of ``sharding.tp_slice``: all-gather the shards and undo the stride interleave."""
    expert = not getattr(param, "allreduce", True)
    group = (parallel_state.get_expert_tensor_parallel_group() if expert
             else parallel_state.get_tensor_model_parallel_group())
    size = dist.get_world_size(group)
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return param.detach().cpu().clone()
    shards = [torch.empty_like(param) for _ in range(size)]
    dist.all_gather(shards, param.detach().contiguous(), group=group)
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    pieces = [torch.chunk(s.cpu(), stride, dim=dim) for s in shards]  # rank r holds chunks r, r+size, ...
    return torch.cat([pieces[j % size][j // size] for j in range(size * stride)], dim=dim)


def _owner(param: torch.Tensor) -> bool:
    if getattr(param, "allreduce", True):
        return parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_tensor_model_parallel_rank() == 0
    return (parallel_state.get_expert_data_parallel_rank() == 0
            and parallel_state.get_expert_tensor_parallel_rank() == 0)


def export(cfg: RunConfig, trainer, out_dir: Path, tokenizer_path: Path | None = None) -> None:
    """Write ``out_dir`` (collective); see ``export.format`` for the format."""
    scratch = Path(f"{out_dir}.parts")
    if dist.get_rank() == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
    dist.barrier()
    current_weights(trainer.model)
    stage = trainer.model.module
    names = local_to_global(stage)
    part = {}
    for name, param in stage.named_parameters():
        full = _full(param)
        if _owner(param):
            part[names[name]] = full
    trainer.tables.settle()  # every TP rank's rows current (a working set's written back) before TP rank 0 reads them
    dist.barrier()
    for layer, table in trainer.tables.owner_tables().items():  # the owners' fp32 rows, on DP and TP rank 0
        part[f"decoder.layers.{layer - 1}.mlp.U_l.weight"] = table
    torch.save(part, scratch / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        weights = {}
        for path in sorted(scratch.glob("rank*.pt")):
            weights.update(torch.load(path, map_location="cpu", weights_only=True))
        config = dataclasses.replace(cfg, host_tables=dataclasses.replace(cfg.host_tables, placement="device"))
        write_export(out_dir, config, weights, tokenizer_path)
        shutil.rmtree(scratch)
    dist.barrier()
