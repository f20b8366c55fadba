"""A rank's trainable state: its model stage in megatron DDP, the optimizer, the LR schedule and the host tables its
STEM layers read from (``host_tables.placement``: the store, or their absence)."""

from __future__ import annotations

from dataclasses import dataclass
import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.enums import AttnMaskType

from stem_megatron import parallel
from stem_megatron.config import RunConfig
from stem_megatron.host_tables.placement import Tables, build_tables
from stem_megatron.model.gpt import build_gpt, transformer_config
from stem_megatron.run_plan import micro_batches_per_step
from stem_megatron.training.finite_chain import FiniteChain
from stem_megatron.training.optim import build_optimizer, build_scheduler, wrap_ddp
from stem_megatron.training.table_optimizer import TableChain, TableOptimizer


@dataclass
class Trainer:
    """What a training step needs: the DDP-wrapped stage, its optimizer and schedule, the STEM store."""

    model: DistributedDataParallel
    optimizer: FiniteChain  # what a step steps and a checkpoint saves: the dense optimizer and the host tables' member
    scheduler: OptimizerParamScheduler
    tables: Tables  # the host tables (``HostTableStore``) or their absence (``NoTables``)


def setup_model(cfg: RunConfig) -> Trainer:
    """Model stage for this rank wrapped in megatron DDP, its optimizer and LR schedule, and the host tables its STEM
    layers read from (``host_tables.placement=host``), their rows a member of the optimizer's chain
    (``TableOptimizer``)."""
    gpu = parallel.on_gpu()
    tconfig = transformer_config(cfg.model, cfg.parallel, on_gpu=gpu, stem=cfg.stem, hash_moe=cfg.hash_moe)
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    tables = build_tables(cfg, tconfig, device,
                          micro_batches_per_step(cfg, parallel_state.get_data_parallel_world_size()))
    # explicit per-document masks need the "arbitrary" type on GPU (fused softmax / TE ignore a mask
    # under "causal"); on CPU both apply it
    mask = AttnMaskType.arbitrary if cfg.data.reset_attention_mask else AttnMaskType.causal
    model = build_gpt(cfg.model, cfg.stem, tconfig, row_source=tables.row_source(),
                      use_te=gpu and parallel.have_transformer_engine(), attn_mask_type=mask, seed=cfg.train.seed,
                      hash_moe=cfg.hash_moe)
    if gpu:
        model.cuda()  # megatron's torch RMSNorm (no TE) is created without a device
    model = wrap_ddp(model, tconfig, cfg.parallel)
    dense = build_optimizer(model, cfg.train, cfg.parallel, bf16=gpu)
    optimizer = (TableChain(dense, TableOptimizer(tables, dense, cfg.host_tables.clip)) if tables.hosted
                 else FiniteChain([dense]))  # the tables' rows a member of the chain, where there are host tables
    scheduler = build_scheduler(optimizer, cfg.train)
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.grad_scale_func = dense.scale_loss
    tconfig.no_sync_func = model.no_sync
    return Trainer(model, optimizer, scheduler, tables)
