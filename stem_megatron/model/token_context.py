"""Hands the micro-batch's token ids (and the STEM rows fetched for them) to STEM layers without
changing megatron-core's forward signatures.

The forward step wraps ``model(tokens, ...)`` in ``token_ids(tokens, vocab_size, rows)``. A STEM layer
deep inside the TransformerBlock passes ``current()`` to its row source, which reads the ids (a table
on the device) or the fetched rows (host-resident tables); the Hash-MoE router reads
``current_token_ids()``. Ids are checked against the vocabulary once, where they first meet a table:
by the fetch that produced ``rows`` (host tables), by the caller on the host copy of the batch (the
training and inference forwards: a check of a GPU tensor would wait for the device), else here on
entry, so a bad id fails with a clear message rather than inside an index kernel (a device assert on GPU).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from stem_megatron.data.integrity import check_token_ids


@dataclass(frozen=True)
class MicroBatchTokens:
    """What a row source may read for the micro-batch being computed."""

    ids: torch.Tensor  # [batch, seq]
    rows: Any = None  # host_tables.transfer.PrefetchedRows when the tables live in host memory


_current: Optional[MicroBatchTokens] = None


@contextlib.contextmanager
def token_ids(tokens: torch.Tensor, vocab_size: Optional[int], rows: Any = None) -> Iterator[None]:
    """Make ``tokens`` ([batch, seq]) and the rows fetched for them visible for one forward pass.

    The ids are range-checked here unless ``rows`` are given (their fetch checked them) or
    ``vocab_size`` is None (the caller checked them).
    """
    global _current
    if rows is None and vocab_size is not None:
        check_token_ids(tokens, vocab_size)
    previous, _current = _current, MicroBatchTokens(tokens, rows)
    try:
        yield
    finally:
        _current = previous


def current() -> MicroBatchTokens:
    if _current is None:
        raise RuntimeError(
            "a STEM layer ran outside `token_ids(...)`: wrap the model call in "
            "stem_megatron.model.token_context.token_ids(tokens, vocab_size)"
        )
    return _current


def current_token_ids() -> torch.Tensor:
    return current().ids
