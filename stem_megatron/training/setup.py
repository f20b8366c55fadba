"""A rank's trainable state: its model stage in megatron DDP, the optimizer, the LR schedule and, with
``host_tables.placement=host``, the host table store its STEM layers read from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec

from stem_megatron import parallel
from stem_megatron.config import RunConfig
from stem_megatron.host_tables.store import HostRowSource, HostTableStore, build_store
from stem_megatron.model.gpt import build_gpt, transformer_config
from stem_megatron.model.stem_mlp import STEM_VARIANTS
from stem_megatron.training.finite_chain import FiniteChain
from stem_megatron.training.optim import build_optimizer, build_scheduler, wrap_ddp
from stem_megatron.training.table_optimizer import TableChain, TableOptimizer


@dataclass
class Trainer:
    """What a training step needs: the DDP-wrapped stage, its optimizer and schedule, the STEM store."""

    model: DistributedDataParallel
    optimizer: MegatronOptimizer  # what a step steps: megatron's chain of the dense optimizer and the host tables'
    scheduler: OptimizerParamScheduler
    store: Optional[HostTableStore]
    dense_optimizer: MegatronOptimizer  # the dense parameters' alone: the dense checkpoint's state (checkpoint/dense.py)


def setup_model(cfg: RunConfig) -> Trainer:
    """Model stage for this rank wrapped in megatron DDP, its optimizer and LR schedule, and (with
    ``host_tables.placement=host``) the host table store its STEM layers read from, its rows a member of the optimizer's
    chain (``TableOptimizer``)."""
    gpu = parallel.on_gpu()
    tconfig = transformer_config(cfg.model, cfg.parallel, on_gpu=gpu, stem=cfg.stem, hash_moe=cfg.hash_moe)
    store, row_source = None, None
    if cfg.host_tables.placement == "host" and cfg.stem.variant in STEM_VARIANTS:
        device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
        store = build_store(cfg, tconfig, device)
        row_source = ModuleSpec(module=HostRowSource, params={"store": store})
    # explicit per-document masks need the "arbitrary" type on GPU (fused softmax / TE ignore a mask
    # under "causal"); on CPU both apply it
    mask = AttnMaskType.arbitrary if cfg.data.reset_attention_mask else AttnMaskType.causal
    model = build_gpt(cfg.model, cfg.stem, tconfig, row_source=row_source,
                      use_te=gpu and parallel.have_transformer_engine(), attn_mask_type=mask, seed=cfg.train.seed,
                      hash_moe=cfg.hash_moe)
    if gpu:
        model.cuda()  # megatron's torch RMSNorm (no TE) is created without a device
    model = wrap_ddp(model, tconfig, cfg.parallel)
    dense = build_optimizer(model, cfg.train, cfg.parallel, bf16=gpu)
    optimizer = (FiniteChain([dense]) if store is None
                 else TableChain(dense, TableOptimizer(store, dense, cfg.host_tables.clip)))
    scheduler = build_scheduler(optimizer, cfg.train)
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.grad_scale_func = dense.scale_loss
    tconfig.no_sync_func = model.no_sync
    return Trainer(model, optimizer, scheduler, store, dense)
