"""The steps a run keeps (rank 0): ``metrics.jsonl`` with a console line (``metrics_file.py``) and the W&B run
(``wandb_run.py``, with ``logging.wandb``), given the same records.

A step is kept every ``train.log_interval`` steps, at ``train.steps``, and whenever it holds what a reader looks for:
a loss spike, a validation, a stop, a step not applied (``update_skipped``).
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from stem_megatron.checkpoint.manager import root_dir
from stem_megatron.config import RunConfig
from stem_megatron.training.metrics_file import MetricsWriter
from stem_megatron.training.preemption import Decision
from stem_megatron.training.wandb_run import WandbTracker


class StepLog:
    """A context manager: the W&B run ends with it (as failed on an error), and ``metrics.jsonl`` is closed."""

    def __init__(self, cfg: RunConfig, resumed: int):
        """``resumed``: ``metrics.jsonl`` keeps the records up to this step (``MetricsWriter``)."""
        rank0, lg = dist.get_rank() == 0, cfg.logging
        self.train = cfg.train
        self.writer = MetricsWriter(cfg.out_dir, rank0, cfg.train.steps, resume_step=resumed)
        self.tracker = WandbTracker(cfg.out_dir, dataclasses.asdict(cfg), project=lg.project, mode=lg.wandb_mode,
                                    name=lg.run_name, tags=lg.tags, entity=lg.entity, group=lg.group,
                                    enabled=rank0 and lg.wandb, resumed=resumed, checkpoints=root_dir(cfg))

    def __enter__(self) -> "StepLog":
        return self

    def __exit__(self, *exc) -> None:
        self.tracker.__exit__(*exc)
        self.writer.close()

    def should_log(self, record: dict, decided: Decision) -> bool:
        step = record["step"]
        return (step % self.train.log_interval == 0 or step == self.train.steps or record["loss_spike"]
                or "valid_loss" in record or decided.stop is not None or record.get("update_skipped"))

    def log(self, record: dict, decided: Decision) -> None:
        """Keep the step's record where ``should_log``; ``decided``: what every rank learned after it."""
        if self.should_log(record, decided):
            self.writer.log(record)
            self.tracker.log(record)
