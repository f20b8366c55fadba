"""``stem.table_init=from_dense``: the STEM tables of a dense model converted to STEM, from calibration passes.

A dense layer computes ``W_d (SiLU(W_g x) ⊙ W_u x)``; its STEM conversion keeps ``W_g`` and ``W_d`` and replaces
``W_u x`` by a row of the token at hand. The row closest to ``W_u x`` over the data, in the mean-squared sense, is
``U_l[t] = W_u E[x_l | t]``: the layer's FFN input (after its pre-MLP norm) averaged over the occurrences of token
``t``. This is ours, not the paper's (which trains STEM from scratch): docs/checkpoints.md, "Hugging Face import".
A pass reads the training mix (``data.blend``) in its proportions, up to ``stem.calibration_tokens``.

A pass runs the dense model as transformers builds it (its own forward, no megatron layout): every rank takes every
world-th window of ``seq_length`` tokens of the training mix, one window a forward (so a window's FFN inputs do not
depend on the windows beside it in a batch), sums each layer's FFN inputs by token id, and the sums and counts are
all-reduced over the world. The sums are fixed-point integers, ``round(x * 2^24)`` in int64: integer addition has
no order, so neither ``index_add_``'s atomics nor the windows' split over ranks nor the all-reduce can change them,
and every rank holds bitwise the same means whatever its layout and run. Ids never seen get ``E[x_l]``, the mean
over every token.

Device bytes, besides what the run holds: the dense model in fp32, one window's activations, and the sums of a
group of layers, V x d int64 each, as many a group as ``stem.calibration_gib`` holds (at least one); a pass per
group, whose forward stops at the group's last layer. A group's sums become its fp32 means (V x d each) one layer at
a time, the means its tables (``checkpoint.hf.load``), then the next group starts. Llama-3.2-1B (V=128256, d=2048,
16 layers, 4.6 GiB in fp32) at the default 4 GiB: 2 layers (3.9 GiB) a group; STEM-1/3 (layers 2, 5, 8, 11, 15) in
3 passes, about 2 forwards of the model per calibration token, STEM-full (layers 1-15) in 8, about 4.7; peak about
11 GiB for either (the model, a group's means and one V x d_ff fp32 table, 3.9 GiB, while it is made).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.datasets.indexed_dataset import IndexedDataset

from stem_megatron.config import ConfigError, RunConfig

SHIFT = 24  # the sums' fixed point: x as round(x * 2^24) (resolution 6e-8, as fine as fp32's at |x| >= 1)
LIMIT = 2 ** 62  # what a sum's bound must stay below: half int64's range (each x rounds by up to half a unit)
ROWS = 4096  # token ids a step while sums become means: fp64 quotients of that many rows on the device, not V


class _Stop(Exception):
    """Raised by the group's last hook: the layers after it are not needed."""


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


def fixed_point(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` as the int64 ``round(x * 2^SHIFT)`` (exact up to the rounding: a power of two scales fp32 exactly)."""
    return torch.round(x * 2.0 ** SHIFT).long()


def check_range(layer: int, amax: float, count: int) -> None:
    """Refuse sums that could overflow: a layer whose FFN inputs reach ``|x| = amax`` (over the world) and a token
    seen ``count`` times (the most of any) bound each sum by ``amax * count * 2^SHIFT``."""
    if not amax * count * 2.0 ** SHIFT < LIMIT:  # also a NaN
        most = int(LIMIT / 2.0 ** SHIFT / amax) if amax > 0 else 0  # amax inf or NaN: 0
        raise ConfigError(f"stem.calibration_tokens: model.layers.{layer}'s FFN inputs reach |x|={amax:.4g} and a "
                          f"token occurs {count} times in the calibration pass, so its fixed-point sums "
                          f"(x * 2^{SHIFT}) could pass 2^62: set fewer stem.calibration_tokens, so that no token "
                          f"occurs more than {most} times")


def _pass(cfg: RunConfig, model, group: list[int], vocab_size: int,
          device: torch.device) -> tuple[dict[int, torch.Tensor], torch.Tensor, torch.Tensor]:
    """One pass over this rank's windows for ``group``'s layers: their sums (int64, V x d), the counts by token id
    and the layers' max ``|x|``, all-reduced over the world."""
    d = model.config.hidden_size
    sums = {layer: torch.zeros(vocab_size, d, dtype=torch.int64, device=device) for layer in group}
    counts = torch.zeros(vocab_size, dtype=torch.int64, device=device)
    amax = torch.zeros(len(group), device=device)
    ids: list[torch.Tensor] = []  # the window's ids, for the hooks

    def hook(i: int, layer: int):
        def add(_module, args):
            x = args[0].reshape(-1, d).float()
            amax[i] = torch.maximum(amax[i], x.abs().max().nan_to_num(torch.inf))  # a NaN: refused as inf
            sums[layer].index_add_(0, ids[0], fixed_point(x))
            if layer == group[-1]:
                raise _Stop
        return add

    handles = [model.model.layers[layer].mlp.register_forward_pre_hook(hook(i, layer)) for i, layer in enumerate(group)]
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        for k, window in enumerate(windows(cfg.data.train_blend(), cfg.model.seq_length, cfg.stem.calibration_tokens)):
            if k % world == rank:
                ids[:] = [torch.from_numpy(window).to(device)]
                counts += torch.bincount(ids[0], minlength=vocab_size)
                try:
                    model.model(input_ids=ids[0][None], use_cache=False)  # the decoder: no logits needed
                except _Stop:
                    pass
    finally:
        for handle in handles:
            handle.remove()
    dist.all_reduce(counts)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    for layer in group:
        dist.all_reduce(sums[layer])
    return sums, counts, amax


def means_of(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``E[x | t]`` (V x d, fp32) from the fixed-point ``sums`` by token id and the ids' ``counts``; ids never seen:
    ``E[x]``, from the sums' column totals added exactly (their high and low 31 bits apart)."""
    means = torch.empty(sums.shape, device=sums.device)
    high, low = (torch.zeros(sums.shape[1], dtype=torch.int64, device=sums.device) for _ in range(2))
    for lo in range(0, len(sums), ROWS):
        block = sums[lo:lo + ROWS]
        high += (block >> 31).sum(0)
        low += (block & (2 ** 31 - 1)).sum(0)
        means[lo:lo + ROWS] = (block.double() / counts[lo:lo + ROWS].clamp(min=1)[:, None] * 2.0 ** -SHIFT).float()
    overall = (high.double() * 2.0 ** 31 + low.double()) / counts.sum().clamp(min=1) * 2.0 ** -SHIFT
    means[counts == 0] = overall.float()
    return means


@torch.no_grad()
def mean_ffn_inputs(cfg: RunConfig, directory: Path, layers: list[int], vocab_size: int,
                    device: torch.device) -> Iterator[dict[int, torch.Tensor]]:
    """``{layer: E[x_l | t]}`` ([vocab_size, d], fp32, on ``device``) for the 0-based ``layers`` (ascending) of the
    dense model in ``directory``, a group of layers at a time (collective over the world: every rank calls it with
    the same ``layers`` and takes every group)."""
    model = _dense_model(directory, device)
    layer_bytes = vocab_size * model.config.hidden_size * 8
    size = max(1, int(cfg.stem.calibration_gib * 2 ** 30) // layer_bytes)
    for start in range(0, len(layers), size):
        group = layers[start:start + size]
        sums, counts, amax = _pass(cfg, model, group, vocab_size, device)
        most = int(counts.max())
        for i, layer in enumerate(group):
            check_range(layer, float(amax[i]), most)
        yield {layer: means_of(sums.pop(layer), counts) for layer in group}
