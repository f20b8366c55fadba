"""Held-out loss and perplexity during training: forward-only passes over fixed validation batches.

Every evaluation reads the same first ``train.eval_iters`` global batches of the validation dataset,
split over DP ranks like training batches, so successive values are comparable. Host-resident STEM
rows come through a prefetcher of their own that reads the tables as of the current step.
"""

from __future__ import annotations

import math

import torch

from stem_megatron.config import RunConfig
from stem_megatron.run_plan import micro_batches_per_step
from stem_megatron.training.data_stream import batch_stream
from stem_megatron.training.step import forward_backward


def check_size(cfg: RunConfig, valid_samples: int) -> None:
    """Fail at start-up, not at the first evaluation, when the validation set is too small."""
    need = cfg.train.eval_iters * cfg.train.global_batch_size
    if cfg.train.eval_iters and valid_samples < need:
        raise ValueError(f"validation needs train.eval_iters * train.global_batch_size = {need} samples but the "
                         f"validation split has {valid_samples}: lower train.eval_iters or set data.valid_samples "
                         f"(megatron repeats the split's documents to fill it)")


def validation_loss(trainer, valid_dataset, cfg: RunConfig, dp: int) -> dict:
    """``valid_loss`` (mean token cross-entropy, nats) and ``valid_ppl`` of the current weights."""
    t = cfg.train
    n_micro = t.eval_iters * micro_batches_per_step(cfg, dp)
    trainer.model.eval()
    try:
        with batch_stream(valid_dataset, cfg, dp, trainer.tables, n_micro, steps=1, training=False) as data, \
                torch.no_grad():
            loss = forward_backward(trainer.model, data, n_micro, t.micro_batch_size, cfg.model.seq_length,
                                    cfg.model.vocab_size, forward_only=True)
    finally:
        trainer.model.train()
    return {"valid_loss": loss, "valid_ppl": math.exp(min(loss, 50.0))}
