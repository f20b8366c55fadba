"""The training run: validate, start process groups, build model/optimizer/data, step, log."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import torch.distributed as dist

from stem_megatron import parallel
from stem_megatron.checkpoint import manager as checkpoints
from stem_megatron.checkpoint.atomic import CheckpointError, resolve
from stem_megatron.config import RunConfig, validate
from stem_megatron.export.writer import export
from stem_megatron.training.components.loss_spikes import LossSpikes
from stem_megatron.training.components.probes import Probes
from stem_megatron.training.components.step_log import StepLog
from stem_megatron.training.components.step_meter import StepMeter
from stem_megatron.training.components.validator import Validator
from stem_megatron.training.data_stream import batch_stream, run_datasets
from stem_megatron.training.preemption import StopSignals
from stem_megatron.training.run_summary import start_block
from stem_megatron.training.setup import Trainer, setup_model
from stem_megatron.training.spikes import SpikeDetector
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


def _resume(cfg: RunConfig, trainer: Trainer, detector: SpikeDetector) -> int:
    """Load the checkpoint this run continues from (or the weights it starts from); returns the step."""
    found = checkpoints.find(cfg)
    if found is not None:
        path, manifest = found
        step = checkpoints.load(path, manifest, cfg, trainer, detector)
        if dist.get_rank() == 0:
            print(f"resumed from {path} after step {step}", flush=True)
        return step
    if cfg.checkpoint.init_from:
        source = resolve(Path(cfg.checkpoint.init_from))
        if source is None:
            raise CheckpointError(f"checkpoint.init_from={cfg.checkpoint.init_from} holds no checkpoint")
        checkpoints.init_weights(source, cfg, trainer)
        if dist.get_rank() == 0:
            print(f"initialised weights and STEM tables from {source}", flush=True)
    return 0


STOPPED = "stopped.json"  # in out_dir while the run is stopped by a signal: the launcher requeues such a job


def _say_stopped(path: Path, step: int, sig, saved) -> None:
    """One line, and ``STOPPED`` for the launcher (rank 0)."""
    path.write_text(json.dumps({"step": step, "signal": sig.name, "checkpoint": str(saved) if saved else None}))
    where = (f"checkpoint {saved}; the same command resumes there" if saved else
             "no checkpoint (checkpoint.save=false)")
    print(f"stopped after step {step} on {sig.name}: {where}", flush=True)


def _train(cfg: RunConfig, dp: int) -> list[dict]:
    t = cfg.train
    rank0 = dist.get_rank() == 0
    train_data, valid_data = run_datasets(cfg)  # collective: rank 0 builds megatron's indices first
    validator = Validator(cfg, valid_data, dp)
    trainer = setup_model(cfg)
    spikes = LossSpikes(cfg.logging)
    resumed = _resume(cfg, trainer, spikes.detector)
    if resumed >= t.steps and rank0:
        print(f"nothing to train: the checkpoint is at step {resumed} of train.steps={t.steps} (for a new run, "
              f"set checkpoint.resume=false or another out_dir)", flush=True)
    n_micro = t.global_batch_size // (t.micro_batch_size * dp)
    if rank0:
        print(f"run directory: {cfg.out_dir}", flush=True)
        for line in start_block(cfg, dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                                parallel.on_gpu()):
            print(line, flush=True)
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out_dir) / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    records = []
    c = cfg.checkpoint
    stopped_file = Path(cfg.out_dir) / STOPPED
    if rank0:
        stopped_file.unlink(missing_ok=True)  # an earlier job's stop: this one resumed from it
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
            saved = None
            if c.save and (step == state.last or (c.save_interval and step % c.save_interval == 0) or decided.save_due
                           or decided.stop):
                saved = checkpoints.save(cfg, trainer, spikes.detector, step)
                state.saved_at = time.monotonic()
                if rank0:
                    print(f"saved checkpoint {saved}", flush=True)
            if decided.stop and step < state.last:
                state.stopped = step
                if rank0:
                    _say_stopped(stopped_file, step, decided.stop, saved)
                break
            due = c.save_interval_min > 0 and time.monotonic() - state.saved_at >= 60 * c.save_interval_min
            signals.send(save_due=due)
    if (cfg.checkpoint.export and state.last == t.steps and resumed < t.steps  # exported already
            and state.stopped is None):
        tokenizer = Path(cfg.data.dir) / "tokenizer.json"
        export(cfg, trainer, Path(cfg.checkpoint.export), tokenizer if tokenizer.exists() else None)
    return records
