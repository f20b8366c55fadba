"""The single-process export (``checkpoint.export``, ``export/writer.py``), once: by the job that trains the run's
last step, with the data's tokenizer beside the weights where there is one."""

from __future__ import annotations

from pathlib import Path

from stem_megatron.config import RunConfig
from stem_megatron.export.writer import export
from stem_megatron.training.setup import Trainer
from stem_megatron.training.train_state import TrainState


class Exporter:
    def __init__(self, cfg: RunConfig, trainer: Trainer):
        self.cfg, self.trainer = cfg, trainer

    def should_export(self, state: TrainState) -> bool:
        """Not after a job that ends sooner (``train.exit_after_steps``, a signal), nor after one that resumed at the
        end: the job that trained the last step exported already."""
        steps = self.cfg.train.steps
        return bool(self.cfg.checkpoint.export) and state.last == steps and state.resumed < steps \
            and state.stopped is None

    def export(self, state: TrainState) -> None:
        if not self.should_export(state):
            return
        tokenizer = Path(self.cfg.data.dir) / "tokenizer.json"
        export(self.cfg, self.trainer, Path(self.cfg.checkpoint.export), tokenizer if tokenizer.exists() else None)
