"""Held-out perplexity of a model on a megatron indexed dataset (``<prefix>.bin/.idx``).

Documents are laid end to end (EOD-separated, as in pretraining) and cut into non-overlapping windows
of ``seq_length + 1`` tokens stepping by ``seq_length``: every token after the first is a target
exactly once with up to ``seq_length - 1`` tokens of context. The tail shorter than a window is not
scored. Documents are streamed, so a large split is never held in memory whole.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core.datasets.indexed_dataset import IndexedDataset


def token_windows(prefix, seq_length: int) -> Iterator[np.ndarray]:
    """Successive ``seq_length + 1``-token windows (overlapping by one token) over the dataset's documents."""
    for suffix in (".idx", ".bin"):
        if not Path(f"{prefix}{suffix}").is_file():
            raise FileNotFoundError(f"{prefix}{suffix} not found: --data takes an indexed dataset prefix "
                                    "(e.g. data_cache/python-doc/valid for valid.bin/valid.idx)")
    dataset = IndexedDataset(str(prefix), mmap=True)
    buffer = np.empty(0, dtype=np.int64)
    for i in range(len(dataset)):
        buffer = np.concatenate([buffer, dataset[i].astype(np.int64)])
        while len(buffer) >= seq_length + 1:
            yield buffer[:seq_length + 1]
            buffer = buffer[seq_length:]


@torch.no_grad()
def held_out_perplexity(model, prefix, batch_size: int = 8, max_windows: Optional[int] = None) -> dict:
    """Mean next-token NLL, perplexity and top-1 accuracy of ``model`` (an ``InferenceModel``) over
    ``prefix``'s windows."""
    total_nll, correct, windows, batch = 0.0, 0, 0, []

    def score(rows: list[np.ndarray]) -> tuple[float, int]:
        x = torch.from_numpy(np.stack(rows))
        logits = model.logits(x[:, :-1]).flatten(0, 1)
        targets = x[:, 1:].flatten().to(logits.device)
        return float(F.cross_entropy(logits, targets, reduction="sum")), int((logits.argmax(-1) == targets).sum())

    for window in token_windows(prefix, model.seq_length):
        if max_windows is not None and windows == max_windows:
            break
        batch.append(window)
        windows += 1
        if len(batch) == batch_size:
            nll, hits = score(batch)
            total_nll, correct, batch = total_nll + nll, correct + hits, []
    if batch:
        nll, hits = score(batch)
        total_nll, correct = total_nll + nll, correct + hits
    if windows == 0:
        raise ValueError(f"{prefix} has fewer than seq_length + 1 = {model.seq_length + 1} tokens: nothing to score")
    tokens = windows * model.seq_length
    return {"data": str(prefix), "windows": windows, "tokens": tokens, "nll": total_nll / tokens,
            "ppl": math.exp(total_nll / tokens), "accuracy": correct / tokens}
