"""One training step: megatron-core's pipeline schedule over the micro-batches, then the optimizer.

Every pipeline stage reads the same micro-batches: the first stage embeds the tokens, the STEM layers
on any stage need them for ``U_l[t]``, the last stage needs the labels.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from stem_megatron.data.integrity import check_token_ids
from stem_megatron.model.token_context import token_ids


def _loss_func(loss_mask, loss_per_token: torch.Tensor):
    """Mean over the tokens the loss mask keeps (``data.eod_mask_loss``; no mask: every token)."""
    loss_per_token = loss_per_token.float()
    if loss_mask is None:
        loss = loss_per_token.mean()
    else:
        loss = (loss_per_token * loss_mask).sum() / loss_mask.sum().clamp(min=1)
    # clone: the schedule divides the returned loss by num_microbatches in place
    return loss, {"lm loss": loss.detach().clone()}


def make_forward_step(vocab_size: int):
    """megatron ``forward_step_func``: the model call inside the token-id context STEM layers read.

    A batch holds ``tokens`` and ``labels``, and from megatron's GPT dataset also ``position_ids``,
    ``loss_mask`` and, with cross-document masking, ``attention_mask`` (True = masked).
    """

    def forward_step(data_iterator: Iterator[dict], model: torch.nn.Module):
        batch = next(data_iterator)
        rows = batch.pop("stem", None)  # host tables: fetched, ids checked, in the prefetch thread
        if rows is None:
            check_token_ids(batch["tokens"], vocab_size)  # on the host tensor: no wait for the device
        if torch.cuda.is_available():  # the data iterator yields host tensors (pinned: the copies are async)
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        tokens = batch["tokens"]
        position_ids = batch.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        with token_ids(tokens, None, rows):
            output = model(tokens, position_ids, batch.get("attention_mask"), labels=batch["labels"])
        return output, functools.partial(_loss_func, batch.get("loss_mask"))

    return forward_step


def forward_backward(model, data_iterator, num_micro_batches: int, micro_batch_size: int, seq_length: int,
                     vocab_size: int, forward_only: bool = False) -> float:
    """Runs the schedule and returns the mean loss of the global batch (same value on every rank)."""
    losses = get_forward_backward_func()(
        forward_step_func=make_forward_step(vocab_size),
        data_iterator=data_iterator,
        model=[model],
        num_microbatches=num_micro_batches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
    return global_mean_loss(losses)


def global_mean_loss(losses: list[dict]) -> float:
    """Average over micro-batches and DP replicas; reaches every rank (only last stages hold losses)."""
    local = torch.zeros(2, dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
    if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
        local[0], local[1] = sum(float(x["lm loss"]) for x in losses), len(losses)
    dist.all_reduce(local)
    return float(local[0] / local[1])


def train_step(trainer, data_iterator, num_micro_batches, micro_batch_size, seq_length, vocab_size,
               skip: bool = False) -> dict:
    """Zero grads, forward/backward all micro-batches, megatron's optimizer step (DP-reduce, clip, update: with host
    tables, their rows too, as a member of its chain), advance the LR. The record's norms are before clipping.

    A step not applied changes no weight, optimizer state, table row or moment, and still advances the LR: one to
    ``skip`` (``train.skip_steps``: its batches read, as the data position is the step, and not trained on), one whose
    loss is not finite (the same on every rank: all-reduced) and one whose gradients' norm is not finite
    (``FiniteChain``). Its record says ``update_skipped``."""
    model, optimizer = trainer.model, trainer.optimizer
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = forward_backward(model, data_iterator, num_micro_batches, micro_batch_size, seq_length, vocab_size)
    lr = optimizer.param_groups[0]["lr"]
    if skip or not math.isfinite(loss):  # host tables: the step's rows still end; dense gradients: zeroed next step
        ok, grad_norm, _ = optimizer.skip()
    else:
        ok, grad_norm, _ = optimizer.step()
    trainer.scheduler.step(increment=1)
    record = {"loss": loss, "grad_norm": float(grad_norm) if grad_norm is not None else None, "lr": lr,
              "update_skipped": not ok}
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        record.update(getattr(part, "step_record", {}))  # a member's own figures (the tables': both norms)
    return record
