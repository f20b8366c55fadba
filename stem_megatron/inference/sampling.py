"""Choosing the next token from logits: greedy, or temperature + nucleus (top-p) sampling.

Sampling draws from a caller-owned ``torch.Generator`` so a seeded run generates the same text.
"""

from __future__ import annotations

from typing import Optional

import torch


def next_token(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
               generator: Optional[torch.Generator] = None) -> int:
    """Id for one position's logits ``[V]``: argmax when ``temperature <= 0``, else a top-p sample."""
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)  # the generator is a CPU one
    sorted_probs, order = torch.sort(probs, descending=True)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
    kept = sorted_probs * keep
    choice = torch.multinomial(kept / kept.sum(), 1, generator=generator)
    return int(order[choice])
