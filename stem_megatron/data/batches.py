"""Deterministic data-parallel micro-batches over a megatron dataset.

Sampling contract (tests rely on it). Samples are ``dataset[i]`` for a megatron ``GPTDataset`` /
``BlendedDataset`` (``data/datasets.py``), already shuffled by megatron's seeded index. With
``GB = micro_batch_size * dp_size * num_micro_batches``, global step ``g`` consumes samples
``[g*GB, (g+1)*GB)``; micro-batch ``k`` of DP rank ``r`` is the contiguous chunk starting at
``g*GB + (k*dp_size + r) * micro_batch_size``. Hence micro-batch ``k`` of DP=2 with size ``b`` on ranks
0 and 1, concatenated, equals micro-batch ``k`` of DP=1 with size ``2b``: changing the DP degree (at a
fixed global batch) does not change which samples a step trains on, and resuming at ``start_step``
needs no state.
"""

import torch


def _collate(samples: list[dict], pin_memory: bool) -> dict:
    keys = ("tokens", "labels", "loss_mask", "position_ids") + (
        ("attention_mask",) if "attention_mask" in samples[0] else ())  # only built with reset_attention_mask
    batch = {key: torch.stack([s[key] for s in samples]) for key in keys}
    return {key: t.pin_memory() for key, t in batch.items()} if pin_memory else batch


def micro_batches(dataset, micro_batch_size, dp_rank, dp_size, start_step=0, num_micro_batches=1, pin_memory=False):
    """Yield micro-batches forever (``num_micro_batches`` per global step from ``start_step``), see the
    module docstring for which samples each (step, rank, micro-batch) gets.

    A batch holds LongTensors ``tokens``, ``labels``, ``position_ids`` ``[b, s]``, a float ``loss_mask``
    ``[b, s]`` and, when the dataset resets attention at document boundaries, a bool ``attention_mask``
    ``[b, 1, s, s]`` (True = masked, megatron's convention). Running past the dataset's samples is an
    error: build it with at least ``steps * global_batch_size`` samples. ``pin_memory`` (GPU): page-locked
    tensors, so the copy to the device does not block the training thread.
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
    global_batch = micro_batch_size * dp_size * num_micro_batches
    step = start_step
    while True:
        for k in range(num_micro_batches):
            first = step * global_batch + (k * dp_size + dp_rank) * micro_batch_size
            if first + micro_batch_size > len(dataset):
                raise IndexError(
                    f"global step {step} needs samples up to {first + micro_batch_size} but the dataset has "
                    f"{len(dataset)}: build it with train_samples >= steps * global_batch_size")
            yield _collate([dataset[i] for i in range(first, first + micro_batch_size)], pin_memory)
        step += 1
