"""Maps parameters between one rank's model stage and the single-process (TP=PP=1) model.

Used to load unsharded weights into a TP/PP layout (tests compare layouts against one process;
single-process export goes the other way). Names: a stage's ``decoder.layers.i`` is global layer
``offset + i``; a TP-sharded parameter is sliced the way megatron initialises it (``partition_dim``
and ``partition_stride``: with stride 2 the SwiGLU ``linear_fc1`` holds [gate_r; up_r]).
"""

from __future__ import annotations

import re

import torch
from megatron.core import parallel_state
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def global_name(local_name: str, offset: int) -> str:
    return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", local_name)


def tp_slice(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's part of ``full`` for a parameter laid out like ``param``."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    chunks = torch.chunk(full, tp_size * stride, dim=dim)
    return torch.cat(chunks[tp_rank::tp_size], dim=dim)


def local_to_global(model: torch.nn.Module) -> dict[str, str]:
    """local parameter name -> single-process name, for this rank's stage."""
    offset = get_transformer_layer_offset(model.config)
    return {name: global_name(name, offset) for name, _ in model.named_parameters()}


@torch.no_grad()
def load_full_weights(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy single-process weights into this rank's (TP/PP-sharded) parameters."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    names = local_to_global(model)
    for name, param in model.named_parameters():
        param.copy_(tp_slice(full[names[name]], param, tp_rank, tp_size))
