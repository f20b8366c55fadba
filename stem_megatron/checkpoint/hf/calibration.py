"""``stem.table_init=from_dense``: the STEM tables of a dense model converted to STEM, from one calibration pass.

A dense layer computes ``W_d (SiLU(W_g x) ⊙ W_u x)``; its STEM conversion keeps ``W_g`` and ``W_d`` and replaces
``W_u x`` by a row of the token at hand. The row closest to ``W_u x`` over the data, in the mean-squared sense, is
``U_l[t] = W_u E[x_l | t]``: the layer's FFN input (after its pre-MLP norm) averaged over the occurrences of token
``t``. This is ours, not the paper's (which trains STEM from scratch): docs/checkpoints.md, "Hugging Face import".
The pass reads the training mix (``data.blend``) in its proportions, up to ``stem.calibration_tokens``.

The pass runs the dense model as transformers builds it (its own forward, no megatron layout): every rank takes every
world-th window of ``seq_length`` tokens of the training mix, sums each planned layer's FFN inputs by token id, and
the sums and counts are all-reduced over the world, so every rank holds the same means whatever its layout. Ids never
seen get ``W_u E[x_l]``, the mean over every token.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.datasets.indexed_dataset import IndexedDataset

from stem_megatron.config import RunConfig

BATCH = 8  # windows a forward


def _prefix_windows(prefix: str, seq_length: int) -> Iterator[np.ndarray]:
    """A dataset's documents, concatenated and cut into ``seq_length`` windows."""
    dataset, buffer = IndexedDataset(prefix), np.empty(0, dtype=np.int64)
    for i in range(len(dataset)):
        buffer = np.concatenate([buffer, dataset[i].astype(np.int64)])
        while buffer.size >= seq_length:
            yield buffer[:seq_length]
            buffer = buffer[seq_length:]


def windows(blend: list[tuple[float, str]], seq_length: int, tokens: int | None) -> Iterator[np.ndarray]:
    """Windows of the training mix, up to ``tokens``: from its prefixes in the blend's proportions (the prefix
    furthest behind its share next), each read once."""
    streams = {i: _prefix_windows(prefix, seq_length) for i, (_, prefix) in enumerate(blend)}
    taken = [0] * len(blend)
    while streams and (tokens is None or sum(taken) * seq_length + seq_length <= tokens):
        i = min(streams, key=lambda j: (taken[j] / blend[j][0], j))
        window = next(streams[i], None)
        if window is None:
            del streams[i]
            continue
        taken[i] += 1
        yield window


def _dense_model(directory: Path, device: torch.device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, trust_remote_code=True)
    return model.to(device).eval()


@torch.no_grad()
def mean_ffn_inputs(cfg: RunConfig, directory: Path, layers: list[int], vocab_size: int,
                    device: torch.device) -> dict[int, torch.Tensor]:
    """``{layer: E[x_l | t]}`` ([vocab_size, d], fp32, on ``device``) for 0-based ``layers`` of the dense model in
    ``directory`` (collective over the world: every rank calls it with the same ``layers``)."""
    model = _dense_model(directory, device)
    d = model.config.hidden_size
    sums = {layer: torch.zeros(vocab_size, d, dtype=torch.float64, device=device) for layer in layers}
    counts = torch.zeros(vocab_size, dtype=torch.float64, device=device)
    batch: list[np.ndarray] = []
    ids: list[torch.Tensor] = []  # the batch's ids, flattened, for the hooks

    def hook(layer):
        def add(_module, args):
            sums[layer].index_add_(0, ids[0], args[0].reshape(-1, d).double())
        return add

    handles = [model.model.layers[layer].mlp.register_forward_pre_hook(hook(layer)) for layer in layers]

    def run() -> None:
        tokens = torch.from_numpy(np.stack(batch)).to(device)
        ids[:] = [tokens.reshape(-1)]
        counts.index_add_(0, ids[0], torch.ones(ids[0].numel(), dtype=torch.float64, device=device))
        model.model(input_ids=tokens, use_cache=False)  # the decoder: the LM head's logits are not needed
        batch.clear()

    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        for k, window in enumerate(windows(cfg.data.train_blend(), cfg.model.seq_length, cfg.stem.calibration_tokens)):
            if k % world == rank:
                batch.append(window)
                if len(batch) == BATCH:
                    run()
        if batch:
            run()
    finally:
        for handle in handles:
            handle.remove()
    dist.all_reduce(counts)
    means = {}
    for layer in layers:
        dist.all_reduce(sums[layer])
        overall = sums[layer].sum(0) / counts.sum().clamp(min=1)
        mean = sums[layer] / counts.clamp(min=1)[:, None]
        mean[counts == 0] = overall
        means[layer] = mean.float()
    return means
