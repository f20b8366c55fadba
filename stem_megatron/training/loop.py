"""The training run: validate, start process groups, build model/optimizer/data, step, log."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import torch.distributed as dist

from stem_megatron import parallel
from stem_megatron.config import RunConfig, validate
from stem_megatron.export.writer import export
from stem_megatron.training.components.checkpointer import Checkpointer
from stem_megatron.training.components.loss_spikes import LossSpikes
from stem_megatron.training.components.probes import Probes
from stem_megatron.training.components.step_log import StepLog
from stem_megatron.training.components.step_meter import StepMeter
from stem_megatron.training.components.validator import Validator
from stem_megatron.training.data_stream import batch_stream, run_datasets
from stem_megatron.training.preemption import StopSignals
from stem_megatron.training.run_summary import start_block
from stem_megatron.training.setup import setup_model
from stem_megatron.training.step import train_step
from stem_megatron.training.train_state import TrainState


def run(cfg: RunConfig) -> list[dict]:
    """Train ``cfg.train.steps`` steps; returns the step records (rank 0 also writes them)."""
    dp = validate(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    parallel.single_process_env()
    parallel.initialize(cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size,
                        cfg.train.seed, ep=cfg.parallel.expert_model_parallel_size)
    try:
        return _train(cfg, dp)
    finally:
        parallel.destroy()


def _train(cfg: RunConfig, dp: int) -> list[dict]:
    t = cfg.train
    rank0 = dist.get_rank() == 0
    train_data, valid_data = run_datasets(cfg)  # collective: rank 0 builds megatron's indices first
    validator = Validator(cfg, valid_data, dp)
    trainer = setup_model(cfg)
    spikes = LossSpikes(cfg.logging)
    checkpointer = Checkpointer(cfg, trainer, spikes.detector)
    resumed = checkpointer.resume()
    n_micro = t.global_batch_size // (t.micro_batch_size * dp)
    if rank0:
        print(f"run directory: {cfg.out_dir}", flush=True)
        for line in start_block(cfg, dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                                parallel.on_gpu()):
            print(line, flush=True)
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out_dir) / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    records = []
    signals = StopSignals(t.stop_deadline_s, dist.new_group(backend="gloo"))  # every rank, here: a collective
    state = TrainState.resuming(t, resumed)
    meter, probes = StepMeter(cfg, trainer, state.last), Probes(cfg)
    with signals, StepLog(cfg, resumed) as step_log, batch_stream(
            train_data, cfg, dp, trainer.store, n_micro, start_step=resumed, steps=state.last - resumed) as data:
        for step in state.steps():
            start = time.perf_counter()
            with probes.around(step):
                out = train_step(trainer, data, n_micro, t.micro_batch_size, cfg.model.seq_length,
                                 cfg.model.vocab_size)
            record = meter.record(step, out, time.perf_counter() - start, data)
            record.update(spikes.check(record))
            record.update(validator.validate(trainer, step))
            records.append(record)
            decided = signals.decided()
            spikes.say(record)
            step_log.log(record, decided)
            saved = checkpointer.save(state, decided)
            if checkpointer.stops(state, decided, saved):
                break
            signals.send(save_due=checkpointer.due(state))
    if (cfg.checkpoint.export and state.last == t.steps and resumed < t.steps  # exported already
            and state.stopped is None):
        tokenizer = Path(cfg.data.dir) / "tokenizer.json"
        export(cfg, trainer, Path(cfg.checkpoint.export), tokenizer if tokenizer.exists() else None)
    return records
