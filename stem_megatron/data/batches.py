"""Fixed-length token windows over an indexed dataset, and deterministic data-parallel micro-batches.

Sampling contract (tests rely on it). Let ``perm`` be the infinite concatenation of per-epoch
permutations of window indices (epoch ``e`` uses ``default_rng((seed, e))``), and
``GB = micro_batch_size * dp_size * num_micro_batches``. Global step ``g`` consumes
``perm[g*GB:(g+1)*GB]``; micro-batch ``k`` of DP rank ``r`` is the contiguous chunk starting at
``(k*dp_size + r) * micro_batch_size``. Hence micro-batch ``k`` of DP=2 with size ``b`` on ranks 0 and 1,
concatenated, equals micro-batch ``k`` of DP=1 with size ``2b``: changing the DP degree (at a fixed global
batch) does not change which samples a step trains on, and resuming at ``start_step`` needs no state.
"""

import functools

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset


def check_token_ids(tokens, vocab_size):
    """Raise ValueError if any id is outside ``[0, vocab_size)``.

    Out-of-range ids would otherwise surface as an opaque embedding index error (or a device-side
    assert on GPU). The min/max check keeps the common, valid case cheap.
    """
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo >= 0 and hi < vocab_size:
        return
    ids = tokens.cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    bad = tuple(np.argwhere((ids < 0) | (ids >= vocab_size))[0].tolist())
    position = bad[0] if len(bad) == 1 else bad
    token = int(ids[bad])
    problem = "negative" if token < 0 else f">= vocab_size {vocab_size}"
    raise ValueError(
        f"token id {token} at position {position} is {problem} (vocab_size {vocab_size}); the tokenizer "
        f"and model.vocab_size disagree: model.vocab_size must cover every tokenizer id"
    )


class TokenWindows:
    """Non-overlapping windows of ``seq_length + 1`` tokens over all documents laid end to end.

    Windows step by ``seq_length`` so window ``i``'s last token is window ``i+1``'s first: every token
    is a target exactly once. Documents are concatenated (separated by their EOD) rather than padded,
    as in standard GPT pretraining.
    """

    def __init__(self, prefix, seq_length, vocab_size):
        dataset = IndexedDataset(str(prefix), mmap=True)
        # One in-memory copy in the storage dtype (uint16 for small vocabularies); fine for ~10M tokens.
        self.tokens = np.concatenate([dataset[i] for i in range(len(dataset))])
        check_token_ids(self.tokens, vocab_size)
        self.seq_length = seq_length
        self.num_windows = (len(self.tokens) - 1) // seq_length
        if self.num_windows < 1:
            raise ValueError(f"{prefix} has {len(self.tokens)} tokens, too few for one window of {seq_length + 1}")

    def window(self, i):
        """Tokens ``[i*seq_length, (i+1)*seq_length]`` (inclusive) as a LongTensor of ``seq_length + 1``."""
        if not 0 <= i < self.num_windows:
            raise IndexError(f"window {i} out of range [0, {self.num_windows})")
        start = i * self.seq_length
        return torch.from_numpy(self.tokens[start : start + self.seq_length + 1].astype(np.int64))


@functools.lru_cache(maxsize=4)
def _epoch_permutation(num_windows, seed, epoch):
    return np.random.default_rng((seed, epoch)).permutation(num_windows)


def micro_batches(windows, micro_batch_size, dp_rank, dp_size, start_step=0, num_micro_batches=1, seed=1234):
    """Yield ``{"tokens", "labels"}`` LongTensors of shape ``[micro_batch_size, seq_length]`` forever.

    Yields ``num_micro_batches`` micro-batches per global step, starting at global step ``start_step``;
    see the module docstring for which windows each (step, rank, micro-batch) gets.
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
    global_batch = micro_batch_size * dp_size * num_micro_batches
    step = start_step
    while True:
        for k in range(num_micro_batches):
            first = step * global_batch + (k * dp_size + dp_rank) * micro_batch_size
            epochs, offsets = np.divmod(np.arange(first, first + micro_batch_size), windows.num_windows)
            ids = [_epoch_permutation(windows.num_windows, seed, e)[o] for e, o in zip(epochs, offsets)]
            batch = torch.stack([windows.window(int(i)) for i in ids])
            yield {"tokens": batch[:, :-1].contiguous(), "labels": batch[:, 1:].contiguous()}
        step += 1
