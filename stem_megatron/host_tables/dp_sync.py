"""STEM gradient sync across data-parallel replicas without an all-to-all.

Each replica holds a compact gradient (its touched ids x this TP rank's columns). The replicas agree
on the union of touched ids (one all-gather of id lists) and all-reduce one ``|union| x cols``
tensor, so the bytes grow with the number of distinct tokens in the global batch, never with the
number of tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def union_all_reduce(ids: torch.Tensor, grads: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Average ``grads`` (rows for sorted unique ``ids``) over ``group``.

    Returns (union ids, averaged rows for them, bytes this rank sent).
    """
    size = dist.get_world_size(group)
    if size == 1:
        return ids, grads, 0
    counts = [torch.zeros(1, dtype=torch.int64, device=ids.device) for _ in range(size)]
    dist.all_gather(counts, torch.tensor([ids.numel()], device=ids.device), group=group)
    longest = int(max(c.item() for c in counts))
    padded = torch.full((longest,), -1, dtype=torch.int64, device=ids.device)
    padded[: ids.numel()] = ids
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    union = torch.unique(torch.cat(gathered))
    union = union[union >= 0]
    dense = torch.zeros(union.numel(), grads.shape[1], dtype=grads.dtype, device=grads.device)
    dense[torch.searchsorted(union, ids)] = grads
    dist.all_reduce(dense, group=group)
    dense /= size
    # ring all-gather of the id lists + ring all-reduce (2 (n-1)/n of the tensor) of the rows
    sent = longest * 8 * (size - 1) + int(2 * (size - 1) / size * dense.numel() * dense.element_size())
    return union, dense, sent
