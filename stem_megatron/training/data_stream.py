"""A run's datasets, and the micro-batch stream its steps (and validation) read, STEM rows attached
when the tables live in host memory."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Optional

import torch
from megatron.core import parallel_state

from stem_megatron.config import RunConfig
from stem_megatron.data.batches import micro_batches
from stem_megatron.data.datasets import build_datasets
from stem_megatron.data.tokenizer import HFTokenizer


def run_datasets(cfg: RunConfig):
    """``build_datasets`` for a run: ``train.steps * train.global_batch_size`` train samples from
    ``data.blend``, validation over ``data.valid_prefixes``, ids checked against ``model.vocab_size``."""
    d = cfg.data
    return build_datasets(
        HFTokenizer(Path(d.dir) / "tokenizer.json"),
        d.train_blend(),
        cfg.model.seq_length,
        cfg.train.steps * cfg.train.global_batch_size,
        cfg.train.seed,
        d.cache_dir or Path(d.dir) / "index_cache",
        cfg.model.vocab_size,
        valid_prefixes=d.valid_prefix_paths(),
        valid_samples=d.valid_samples,
        reset_position_ids=d.reset_position_ids,
        reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss,
    )


def batch_stream(dataset, cfg: RunConfig, dp: int, tables, num_micro_batches: int, start_step: int = 0,
                 steps: Optional[int] = None, training: bool = True):
    """This DP rank's micro-batches of ``dataset`` from step ``start_step`` (``steps`` steps, or on until
    the dataset ends) with their rows, as the tables are now, attached by ``tables`` (``HostTableStore.stream``: a
    context manager that makes the first step's rows readable on entry; without host tables, as they are)."""
    data = micro_batches(dataset, cfg.train.micro_batch_size, parallel_state.get_data_parallel_rank(), dp,
                         start_step=start_step, num_micro_batches=num_micro_batches,
                         pin_memory=torch.cuda.is_available())
    if steps is not None:
        data = itertools.islice(data, steps * num_micro_batches)
    return tables.stream(data, num_micro_batches, cfg.host_tables.prefetch_depth, training)
