"""Dense-parameter optimizer and LR schedule, both megatron-core's (paper Table 2 defaults).

AdamW (megatron's distributed optimizer when enabled: optimizer state sharded over DP), global
grad-norm clipping, warmup then cosine/linear decay to ``min_lr_ratio`` x peak.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import DistributedOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.transformer_config import TransformerConfig

from stem_megatron.config import ParallelConfig, TrainConfig


def wrap_ddp(model: torch.nn.Module, config: TransformerConfig, parallel: ParallelConfig) -> DistributedDataParallel:
    """megatron-core DDP: contiguous fp32 grad buffers, one all-reduce (or reduce-scatter) per bucket.
    ``parallel.overlap_grad_reduce`` issues each bucket's from backward, ``overlap_param_gather`` the weights'
    all-gather from the next forward (docs/cluster.md). With the distributed optimizer the buffers' layout (each
    parameter's place in its DP shard) is computed here from the DP group sizes, as megatron-core >= 0.19 asks of a
    caller; its checkpoints with several buckets: checkpoint/bucket_offsets.py."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=parallel.overlap_grad_reduce,
        overlap_param_gather=parallel.overlap_param_gather,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
        bucket_size=parallel.ddp_bucket_size,
    )
    layout = None
    if ddp_config.use_distributed_optimizer:
        layout = DistributedOptimizer.compute_full_param_layout(
            [p for p in model.parameters() if p.requires_grad], _bucket_size(parallel),
            parallel_state.get_data_parallel_world_size(with_context_parallel=True),
            ddp_config, expert_data_parallel_world_size=parallel_state.get_expert_data_parallel_world_size())
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model, full_param_layout=layout)


def _bucket_size(parallel: ParallelConfig) -> Optional[int]:
    """Elements per bucket, as megatron's DDP picks them when it lays its buffers out itself: the one set, else
    without overlap one bucket; with it megatron's default (40M elements, 1M per DP rank past 40), on the first
    pipeline stage only (later stages' reductions are off the step's path)."""
    if parallel.ddp_bucket_size is not None:
        return parallel.ddp_bucket_size
    if not parallel.overlap_grad_reduce or parallel_state.get_pipeline_model_parallel_rank() > 0:
        return None
    return max(40_000_000, 1_000_000 * parallel_state.get_data_parallel_world_size(with_context_parallel=True))


def build_optimizer(model: DistributedDataParallel, train: TrainConfig, parallel: ParallelConfig, bf16: bool):
    config = OptimizerConfig(
        optimizer="adam",
        lr=train.lr,
        min_lr=train.lr * train.min_lr_ratio,
        weight_decay=train.weight_decay,
        adam_beta1=train.adam_beta1,
        adam_beta2=train.adam_beta2,
        adam_eps=1e-8,
        clip_grad=train.clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
    )
    return get_megatron_optimizer(config, [model])


def build_scheduler(optimizer, train: TrainConfig) -> OptimizerParamScheduler:
    """Schedule in optimizer steps; warmup is ``warmup_ratio`` of the run (at least one step). A resume takes the step
    from the checkpoint and the schedule from this config (megatron's ``override_opt_param_scheduler``), so a changed
    lr, min lr, warmup, decay style, length or weight decay applies from the resumed step on."""
    warmup = max(1, round(train.warmup_ratio * train.steps))
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=train.lr,
        min_lr=train.lr * train.min_lr_ratio,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(train.steps, warmup + 1),
        lr_decay_style=train.decay_style,
        start_wd=train.weight_decay,
        end_wd=train.weight_decay,
        wd_incr_steps=train.steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )
