"""Maps parameters between one rank's model stage and the single-process (TP=PP=1) model.

Used to load unsharded weights into a TP/PP/EP layout (tests compare layouts against one process;
single-process export goes the other way). Names: a stage's ``decoder.layers.i`` is global layer
``offset + i``; expert ``local_experts.j`` of EP rank r is global expert ``r * experts/ep + j``; a
TP-sharded parameter is sliced the way megatron initialises it (``partition_dim`` and
``partition_stride``: with stride 2 the SwiGLU ``linear_fc1`` holds [gate_r; up_r]).
"""

from __future__ import annotations

import re

import torch
from megatron.core import parallel_state
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
# Transformer Engine keeps a layer's norms inside the linears they are fused into and numbers the
# experts of a grouped GEMM as weight suffixes; the single-process model (megatron's local modules)
# has them as modules of their own.
_TE_NAMES = (
    (re.compile(r"\.self_attention\.linear_qkv\.layer_norm_(weight|bias)$"), r".input_layernorm.\1"),
    (re.compile(r"\.mlp\.linear_fc1\.layer_norm_(weight|bias)$"), r".pre_mlp_layernorm.\1"),
    (re.compile(r"\.experts\.linear_fc([12])\.weight(\d+)$"), r".experts.local_experts.\2.linear_fc\1.weight"),
)


def local_module_name(name: str) -> str:
    """The name a (Transformer Engine) parameter has in a model built from megatron's local modules."""
    for pattern, replacement in _TE_NAMES:
        name = pattern.sub(replacement, name)
    return name


def global_name(local_name: str, offset: int, expert_offset: int = 0) -> str:
    """Single-process name: local-module name, global layer index, global expert index under EP."""
    name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", local_module_name(local_name))
    return _EXPERT.sub(lambda m: f".local_experts.{int(m.group(1)) + expert_offset}.", name)


def tp_slice(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's part of ``full`` for a parameter laid out like ``param``."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    chunks = torch.chunk(full, tp_size * stride, dim=dim)
    return torch.cat(chunks[tp_rank::tp_size], dim=dim)


def local_to_global(model: torch.nn.Module) -> dict[str, str]:
    """local parameter name -> single-process name, for this rank's stage."""
    config = model.config
    offset = get_transformer_layer_offset(config)
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    expert_offset = ep_rank * (config.num_moe_experts or 0) // parallel_state.get_expert_model_parallel_world_size()
    return {name: global_name(name, offset, expert_offset) for name, _ in model.named_parameters()}


def shard_of(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` for ``param``: expert weights (megatron marks them
    ``allreduce=False``) split over the expert-TP group, the others over the TP group."""
    if getattr(param, "allreduce", True):
        rank = parallel_state.get_tensor_model_parallel_rank()
        size = parallel_state.get_tensor_model_parallel_world_size()
    else:
        rank, size = (parallel_state.get_expert_tensor_parallel_rank(),
                      parallel_state.get_expert_tensor_parallel_world_size())
    return tp_slice(full, param, rank, size)


@torch.no_grad()
def load_full_weights(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy single-process weights into this rank's (TP/PP/EP-sharded) parameters."""
    names = local_to_global(model)
    for name, param in model.named_parameters():
        param.copy_(shard_of(full[names[name]], param))
