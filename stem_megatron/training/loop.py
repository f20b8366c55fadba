"""The training run: validate, start process groups, then the loop: a step and the calls of the components
(``components/``) around it, each of which decides when it acts."""

from __future__ import annotations

import os
import time

import torch.distributed as dist

from stem_megatron import parallel
from stem_megatron.checkpoint.hf.model_config import check_hf_import
from stem_megatron.config import RunConfig, validate
from stem_megatron.run_plan import micro_batches_per_step
from stem_megatron.training.components.checkpointer import Checkpointer
from stem_megatron.training.components.exporter import Exporter
from stem_megatron.training.components.loss_spikes import LossSpikes
from stem_megatron.training.components.probes import Probes
from stem_megatron.training.components.skipped_steps import SkippedSteps
from stem_megatron.training.components.step_log import StepLog
from stem_megatron.training.components.step_meter import StepMeter
from stem_megatron.training.components.validator import Validator
from stem_megatron.training.data_stream import batch_stream, run_datasets
from stem_megatron.training.preemption import StopSignals
from stem_megatron.training.run_summary import say_start
from stem_megatron.training.setup import setup_model
from stem_megatron.training.step import train_step
from stem_megatron.training.train_state import TrainState


def run(cfg: RunConfig) -> list[dict]:
    """Train ``cfg.train.steps`` steps; returns the step records (rank 0 also writes them)."""
    dp = validate(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    if cfg.checkpoint.init_from_hf:
        check_hf_import(cfg)
    parallel.single_process_env()
    parallel.initialize(cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size,
                        cfg.train.seed, ep=cfg.parallel.expert_model_parallel_size)
    try:
        return _train(cfg, dp)
    finally:
        parallel.destroy()


def _train(cfg: RunConfig, dp: int) -> list[dict]:
    """Every rank makes these calls in this order, and so issues the collectives in them in one order."""
    t, m = cfg.train, cfg.model
    train_data, valid_data = run_datasets(cfg)  # collective: rank 0 builds megatron's indices first
    validator = Validator(cfg, valid_data, dp)
    trainer = setup_model(cfg)
    spikes = LossSpikes(cfg.logging)
    checkpointer = Checkpointer(cfg, trainer, spikes.detector)
    resumed = checkpointer.resume()
    say_start(cfg)
    signals = StopSignals(t.stop_deadline_s, dist.new_group(backend="gloo"))  # every rank, here: a collective
    state = TrainState.resuming(t, resumed)
    probes, meter, skips, records = Probes(cfg), StepMeter(cfg, trainer, state.last), SkippedSteps(cfg), []
    n_micro = micro_batches_per_step(cfg, dp)
    with signals, StepLog(cfg, resumed) as step_log, batch_stream(
            train_data, cfg, dp, trainer.tables, n_micro, start_step=resumed, steps=state.last - resumed) as data:
        for step in state.steps():
            start = time.perf_counter()
            with probes.around(step):
                out = train_step(trainer, data, n_micro, t.micro_batch_size, m.seq_length, m.vocab_size,
                                 skip=skips.told(step))
            record = meter.record(step, out, time.perf_counter() - start, data)
            record.update(skips.count(record))
            record.update(spikes.check(record))
            record.update(validator.validate(trainer, step))
            records.append(record)
            decided = signals.decided()  # the previous step's exchange (a collective): one answer on every rank
            spikes.say(record)
            step_log.log(record, decided)
            skips.check(record)  # too many steps in a row not finite: the run ends here, on every rank
            saved = checkpointer.save(state, decided)
            if checkpointer.stops(state, decided, saved):
                break
            signals.send(save_due=checkpointer.due(state))
    Exporter(cfg, trainer).export(state)
    return records
