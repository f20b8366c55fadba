"""Hands the micro-batch's token ids (and prefetched STEM rows) to STEM layers without changing
megatron-core's forward signatures.

The forward step wraps ``model(tokens, ...)`` in ``token_ids(tokens, vocab_size, prefetched)``; a STEM
layer deep inside the TransformerBlock reads ``current_token_ids()`` and, with the host-resident store,
``current_prefetched()``. Ids are validated against the vocabulary on entry, so a bad id fails here with
a clear message rather than inside an index kernel (a device assert on GPU).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from stem_megatron.data.batches import check_token_ids

_current: Optional[tuple[torch.Tensor, Any]] = None


@contextlib.contextmanager
def token_ids(tokens: torch.Tensor, vocab_size: int, prefetched: Any = None) -> Iterator[None]:
    """Make ``tokens`` ([batch, seq]) and the rows prefetched for them visible for one forward pass."""
    global _current
    check_token_ids(tokens, vocab_size)
    previous, _current = _current, (tokens, prefetched)
    try:
        yield
    finally:
        _current = previous


def _get() -> tuple[torch.Tensor, Any]:
    if _current is None:
        raise RuntimeError(
            "a STEM layer ran outside `token_ids(...)`: wrap the model call in "
            "stem_megatron.model.token_context.token_ids(tokens, vocab_size)"
        )
    return _current


def current_token_ids() -> torch.Tensor:
    return _get()[0]


def current_prefetched() -> Any:
    prefetched = _get()[1]
    if prefetched is None:
        raise RuntimeError("a host-resident STEM layer ran without prefetched rows: wrap the data iterator "
                           "in stem_megatron.stem.prefetch.RowPrefetcher")
    return prefetched
