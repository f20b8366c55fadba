"""Train and validation datasets: megatron-core ``GPTDataset``s, blended by weight.

megatron does the work. ``GPTDataset`` packs documents into samples of ``seq_length + 1`` tokens (a
document may span samples, a sample may hold several documents, EOD between them) and shuffles the
samples with an index seeded by ``seed``; ``BlendedDataset`` draws from several prefixes in proportion
to their weights. ``reset_attention_mask`` keeps attention inside each document of a sample,
``reset_position_ids`` restarts positions after every EOD, ``eod_mask_loss`` drops EOD targets from
the loss (cross-document masking for packed long-context data).

Index files (document, sample, shuffle and blend indices) are cached under ``cache_dir``:
megatron builds them on global rank 0, barriers, then the other ranks load them, so ``cache_dir``
must be a filesystem every rank sees. The cache subdirectory is named by a digest of the ``.idx``
files, so re-preprocessing a prefix never reuses indices computed for its old contents.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch.distributed as dist
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from stem_megatron.data.integrity import check_indexed_dataset
from stem_megatron.data.tokenizer import HFTokenizer


def _index_digest(prefixes) -> str:
    digest = hashlib.sha256()
    for prefix in prefixes:
        digest.update(Path(f"{prefix}.idx").read_bytes())
    return digest.hexdigest()[:16]


def build_datasets(
    tokenizer: HFTokenizer,
    train_blend: list[tuple[float, str]],
    seq_length: int,
    train_samples: int,
    seed: int,
    cache_dir,
    vocab_size: int,
    valid_prefixes: list[str] | None = None,
    valid_samples: int | None = None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
):
    """``(train, valid)``: ``train`` has at least ``train_samples`` samples drawn from ``train_blend``
    (``(weight, prefix)`` pairs), ``valid`` ``valid_samples`` samples (None: one pass) over
    ``valid_prefixes`` (None: no validation dataset).

    Collective: every rank calls it after torch.distributed is initialized (a world of one is fine)
    and gets its own copy; ``sample = dataset[i]`` is a dict of ``tokens``, ``labels``, ``loss_mask``,
    ``position_ids`` and, with ``reset_attention_mask``, ``attention_mask`` (``[1, s, s]``, True = masked).
    Every prefix is integrity-checked and its token ids checked against ``vocab_size`` first, on every
    rank, so a bad file fails everywhere before any barrier.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_datasets is collective (megatron builds the indices on rank 0, then the "
                           "others load them): call it on every rank after parallel.initialize")
    if not train_blend or any(weight <= 0 for weight, _ in train_blend):
        raise ValueError(f"train_blend {train_blend} needs at least one (weight, prefix) pair, weights > 0")
    train_prefixes = [str(prefix) for _, prefix in train_blend]
    valid_prefixes = [str(prefix) for prefix in valid_prefixes or []]
    for prefix in train_prefixes + valid_prefixes:
        check_indexed_dataset(prefix, vocab_size)
    config = dataset_config(tokenizer, train_blend, valid_prefixes, seq_length, seed, cache_dir, reset_position_ids,
                            reset_attention_mask, eod_mask_loss)
    sizes = [train_samples, valid_samples, None]
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return train, valid


def dataset_config(tokenizer, train_blend, valid_prefixes, seq_length, seed, cache_dir, reset_position_ids=False,
                   reset_attention_mask=False, eod_mask_loss=False) -> GPTDatasetConfig:
    """megatron's config for ``build_datasets`` (also what ``benchmarks/dataset_index.py`` times megatron with)."""
    train_prefixes = [str(prefix) for _, prefix in train_blend]
    weights = [float(weight) for weight, _ in train_blend] if len(train_blend) > 1 else None
    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend_per_split=[(train_prefixes, weights), (valid_prefixes, None) if valid_prefixes else None, None],
        path_to_cache=str(Path(cache_dir) / _index_digest(train_prefixes + valid_prefixes)),
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=reset_attention_mask,  # otherwise causal attention needs no mask tensor
    )
