"""The single-process (TP=PP=EP=1, on-device STEM tables) model an export's weights belong to.

Exports name and shape their weights after this model, whatever layout trained them, so reading,
checking and running an export all build it here. megatron-core builds modules against its global
parallel state, so a world-of-one state is started when none exists; a running job may reuse its
own state only if it is TP=PP=EP=1.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from stem_megatron import parallel
from stem_megatron.config import ParallelConfig, RunConfig
from stem_megatron.model.gpt import build_gpt, transformer_config


def single_process_config(cfg: RunConfig) -> RunConfig:
    """``cfg`` with the layout of an export: one process, STEM tables as device parameters."""
    return dataclasses.replace(
        cfg, host_tables=dataclasses.replace(cfg.host_tables, placement="device"), parallel=ParallelConfig()
    )


def ensure_single_process_state(seed: int) -> None:
    """Start a world-of-one gloo/NCCL group and megatron's 1x1x1 grid unless a usable one exists."""
    if not dist.is_initialized() or not parallel_state.model_parallel_is_initialized():
        if dist.is_initialized() and dist.get_world_size() != 1:
            raise RuntimeError(
                "torch.distributed runs with several ranks but megatron's parallel state is not initialized: "
                "call stem_megatron.parallel.initialize(1, 1, seed) first, or load the export in one process"
            )
        parallel.single_process_env()
        parallel.initialize(1, 1, seed)
        return
    sizes = {
        "tensor": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
        "expert": parallel_state.get_expert_model_parallel_world_size(),
    }
    if any(size != 1 for size in sizes.values()):
        raise RuntimeError(
            f"megatron's parallel state has model-parallel sizes {sizes}; the single-process export model needs "
            "TP=PP=EP=1: load the export in a separate process (or after stem_megatron.parallel.destroy())"
        )


def build_single_process_model(cfg: RunConfig, meta: bool = False) -> GPTModel:
    """The export's model for ``cfg`` (placement and layout forced). ``meta``: shapes only, no memory.

    Always megatron's local (non-Transformer-Engine) modules in fp32, so parameter names match the
    export on any machine; the caller moves the model to a GPU if it wants one.
    """
    cfg = single_process_config(cfg)
    ensure_single_process_state(cfg.train.seed)
    config = transformer_config(cfg.model, cfg.parallel, on_gpu=False, use_cpu_initialization=True, stem=cfg.stem,
                                hash_moe=cfg.hash_moe)
    with torch.device("meta") if meta else contextlib.nullcontext():
        return build_gpt(cfg.model, cfg.stem, config, use_te=False, pre_process=True, post_process=True,
                         hash_moe=cfg.hash_moe)


def parameter_shapes(cfg: RunConfig) -> dict[str, torch.Size]:
    """``{name: shape}`` of the export's model for ``cfg``, from a meta-device build."""
    return {name: p.shape for name, p in build_single_process_model(cfg, meta=True).named_parameters()}
