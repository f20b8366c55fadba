"""The training run: validate, start process groups, build model/optimizer/data, step, log."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from pathlib import Path

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads

from stem_megatron import parallel
from stem_megatron.config import RunConfig, validate
from stem_megatron.data.batches import TokenWindows, micro_batches
from stem_megatron.model.gpt import build_gpt, transformer_config
from stem_megatron.training.metrics import MetricsWriter
from stem_megatron.training.optim import build_optimizer, build_scheduler, wrap_ddp
from stem_megatron.training.step import train_step


def _single_process_env() -> None:
    """Lets ``stem-train`` run without torchrun as a world of one."""
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def setup_model(cfg: RunConfig):
    """Model stage for this rank wrapped in megatron DDP, its optimizer and LR schedule."""
    gpu = parallel.on_gpu()
    tconfig = transformer_config(cfg.model, cfg.parallel, on_gpu=gpu)
    model = build_gpt(cfg.model, cfg.stem, tconfig, use_te=gpu and parallel.have_transformer_engine())
    if gpu:
        model.cuda()  # megatron's torch RMSNorm (no TE) is created without a device
    model = wrap_ddp(model, tconfig, cfg.parallel)
    optimizer = build_optimizer(model, cfg.train, cfg.parallel, bf16=gpu)
    scheduler = build_scheduler(optimizer, cfg.train)
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.grad_scale_func = optimizer.scale_loss
    tconfig.no_sync_func = model.no_sync
    return model, optimizer, scheduler


def run(cfg: RunConfig) -> list[dict]:
    """Train ``cfg.train.steps`` steps; returns the step records (rank 0 also writes them)."""
    dp = validate(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    windows = TokenWindows(str(Path(cfg.data.dir) / "train"), cfg.model.seq_length, cfg.model.vocab_size)
    _single_process_env()
    parallel.initialize(cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size,
                        cfg.train.seed)
    try:
        return _train(cfg, dp, windows)
    finally:
        parallel.destroy()


def _train(cfg: RunConfig, dp: int, windows: TokenWindows) -> list[dict]:
    t = cfg.train
    rank0 = dist.get_rank() == 0
    model, optimizer, scheduler = setup_model(cfg)
    n_micro = t.global_batch_size // (t.micro_batch_size * dp)
    data = micro_batches(windows, t.micro_batch_size, parallel_state.get_data_parallel_rank(), dp,
                         num_micro_batches=n_micro, seed=t.seed)
    if rank0:
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out_dir) / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    writer = MetricsWriter(cfg.out_dir, rank0, t.steps)
    records = []
    tokens_per_step = t.global_batch_size * cfg.model.seq_length
    for step in range(1, t.steps + 1):
        start = time.perf_counter()
        out = train_step(model, optimizer, scheduler, data, n_micro, t.micro_batch_size,
                         cfg.model.seq_length, cfg.model.vocab_size)
        elapsed = time.perf_counter() - start
        record = {"step": step, **out, "step_time_s": elapsed, "tokens": step * tokens_per_step,
                  "tokens_per_s": tokens_per_step / elapsed}
        records.append(record)
        if step % t.log_interval == 0 or step == t.steps:
            writer.log(record)
    writer.close()
    return records
