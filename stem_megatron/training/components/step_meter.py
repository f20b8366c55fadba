"""A step's record from what it measured: its outputs (loss, grad norms, LR), time and tokens, the ETA and memory
(``run_summary.StepClock``), the host tables' counters and the wait for their rows, Hash-MoE's counters, and
throughput (``flops/mfu.py``). Loss spikes and validation add theirs after (``LossSpikes``, ``Validator``)."""

from __future__ import annotations

import torch.distributed as dist

from stem_megatron.config import RunConfig
from stem_megatron.flops.mfu import device_peak_tflops, model_flops_per_token, throughput_metrics
from stem_megatron.model.hash_moe import take_moe_stats
from stem_megatron.training.run_summary import StepClock
from stem_megatron.training.setup import Trainer


class StepMeter:
    def __init__(self, cfg: RunConfig, trainer: Trainer, last_step: int):
        """The ETA's clock starts now: the first step's time includes what comes before it."""
        self.clock = StepClock(last_step)
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
        self.flops_per_token = model_flops_per_token(cfg.model, cfg.stem, cfg.hash_moe)
        self.peak_tflops = cfg.logging.peak_tflops or device_peak_tflops()
        self.devices = dist.get_world_size()
        self.tables, self.model = trainer.tables, trainer.model

    def record(self, step: int, out: dict, elapsed: float, data) -> dict:
        """The record of ``step``, whose ``train_step`` returned ``out`` after ``elapsed`` seconds reading ``data``
        (the batch stream). Every counter is taken, so the next step's start at zero."""
        tokens_per_s = self.tokens_per_step / elapsed
        record = {"step": step, **out, "step_time_s": elapsed, "tokens": step * self.tokens_per_step,
                  "tokens_per_s": tokens_per_s, **self.clock.tick(step)}
        record.update(self.table_counters(data))
        record.update(take_moe_stats(self.model))
        record.update(throughput_metrics(tokens_per_s, self.flops_per_token, self.peak_tflops, self.devices))
        return record

    def table_counters(self, data) -> dict:
        """The host tables' counters of the step and the training thread's wait for its rows in ``data``
        (``HostTableStore.take_stats``: a collective over the node); none without host tables."""
        return self.tables.take_stats(data)
