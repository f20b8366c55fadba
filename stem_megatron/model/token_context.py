"""Hands the micro-batch's token ids to STEM layers without changing megatron-core's forward signatures.

The forward step wraps ``model(tokens, ...)`` in ``token_ids(tokens)``; a STEM layer deep inside the
TransformerBlock reads ``current_token_ids()``. Ids are validated against the vocabulary on entry, so a
bad id fails here with a clear message rather than inside an index kernel (a device assert on GPU).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from stem_megatron.data.batches import check_token_ids

_current: Optional[torch.Tensor] = None


@contextlib.contextmanager
def token_ids(tokens: torch.Tensor, vocab_size: int) -> Iterator[None]:
    """Make ``tokens`` ([batch, seq]) visible to STEM layers for one forward pass."""
    global _current
    check_token_ids(tokens, vocab_size)
    previous, _current = _current, tokens
    try:
        yield
    finally:
        _current = previous


def current_token_ids() -> torch.Tensor:
    if _current is None:
        raise RuntimeError(
            "a STEM layer ran outside `token_ids(...)`: wrap the model call in "
            "stem_megatron.model.token_context.token_ids(tokens, vocab_size)"
        )
    return _current
