"""Loss spikes in the step record, and a line for each one (rank 0): ``training/spikes.py``'s detector, whose
statistics a checkpoint keeps (``detector``)."""

from __future__ import annotations

import torch.distributed as dist

from stem_megatron.config import LoggingConfig
from stem_megatron.training.spikes import SpikeDetector


class LossSpikes:
    def __init__(self, lg: LoggingConfig):
        self.detector = SpikeDetector(lg.spike_window, lg.spike_k, lg.spike_warmup, detrend=lg.spike_detrend)
        self.rank0 = dist.get_rank() == 0

    def check(self, record: dict) -> dict:
        """The record's ``loss_spike``, ``loss_spike_size`` and ``loss_spike_count``: every step, in step order."""
        return self.detector.update(record["loss"])

    def say(self, record: dict) -> None:
        """A line for a spike of finite size (a non-finite loss has the step line's warning)."""
        if record["loss_spike"] and self.rank0 and record["loss_spike_size"] is not None:
            print(f"loss spike at step {record['step']}: {record['loss']:.4f} is {record['loss_spike_size']:.1f} "
                  f"std above the recent losses ({record['loss_spike_count']} so far)", flush=True)
