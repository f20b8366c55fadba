"""Distinct token ids in a batch of a run, expected of the 128k-vocabulary token profile (benchmarks/data/README.md):
the rows a micro-batch and a step fetch, and whose gradients a step lands, where the bound (every token a new id)
overstates them 3-8x at the recipes' batches. The memory plan's default (``stem-flops --memory``); the GPU step
benchmark draws its corpus from the same profile (``benchmarks/gpu_step.py``)."""

from __future__ import annotations

import functools

import numpy as np

from stem_megatron.config import RunConfig
from stem_megatron.flops.arch import REPO, FlopsError
from stem_megatron.run_plan import micro_batches_per_step

PROFILE = REPO / "benchmarks" / "data" / "token_counts_128k.npy"  # per-id counts of 32.1M tokens


def profile_ids(counts: np.ndarray, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids 1..V-1, their probabilities): the profile's V-1 most frequent ids renumbered in their order, so a
    model with the profile's vocabulary keeps its ids and a smaller one keeps the frequent ones."""
    counts = counts.astype(np.float64)
    counts[0] = 0.0  # id 0 is EOD
    top = np.sort(np.argsort(-counts, kind="stable")[: vocab - 1])
    weights = counts[top]
    if weights.sum() == 0:
        raise ValueError("the token profile holds no counts")
    return np.arange(1, len(top) + 1), weights / weights.sum()


def expected_distinct(p: np.ndarray, tokens: float) -> float:
    """E[distinct ids] when ``tokens`` ids are drawn independently with probabilities ``p``."""
    return float(-np.expm1(tokens * np.log1p(-p)).sum())


def expected_distinct_ids(counts: np.ndarray, vocab: int, tokens: tuple[int, ...]) -> tuple[int, ...]:
    """The distinct ids expected in each of ``tokens`` ids drawn independently from the profile, e.g. 1,777 and
    6,528 of 4,096 and 32,768 at V = 128,256. Independent draws overstate packed documents a little (16,018 at
    262,144 tokens where packed 4096-token sequences of the same text hold 12,646: the README)."""
    p = profile_ids(counts, vocab)[1]
    return tuple(min(n, round(expected_distinct(p, n))) for n in tokens)


@functools.lru_cache(maxsize=1)
def profile_counts() -> np.ndarray:
    """The checkout's token profile."""
    if not PROFILE.is_file():
        raise FlopsError(f"no token profile at {PROFILE}: pass --distinct-ids and --step-distinct-ids")
    return np.load(PROFILE)


def run_distinct_ids(cfg: RunConfig, dp: int) -> tuple[int, int, int]:
    """(a micro-batch's, a DP rank's step's, the DP group's step's) distinct ids, expected of the run's batches drawn
    from the profile at its vocabulary."""
    tokens = cfg.train.micro_batch_size * cfg.model.seq_length
    step = micro_batches_per_step(cfg, dp) * tokens
    return expected_distinct_ids(profile_counts(), cfg.model.vocab_size, (tokens, step, dp * step))
