"""Validation in the step record: ``valid_loss`` and ``valid_ppl`` every ``train.eval_interval`` steps and after
``train.steps`` (``training/validation.py``; ``train.eval_iters=0``: never)."""

from __future__ import annotations

from stem_megatron.config import RunConfig
from stem_megatron.training.setup import Trainer
from stem_megatron.training.validation import check_size, validation_loss


class Validator:
    def __init__(self, cfg: RunConfig, valid_data, dp: int):
        """Fails here, before the model is built, when the validation split is too small (``check_size``)."""
        self.cfg, self.valid_data, self.dp = cfg, valid_data, dp
        if cfg.train.eval_iters:
            check_size(cfg, len(valid_data))

    def should_validate(self, step: int) -> bool:
        t = self.cfg.train
        return bool(t.eval_iters) and (step == t.steps or (bool(t.eval_interval) and step % t.eval_interval == 0))

    def validate(self, trainer: Trainer, step: int) -> dict:
        """The record's validation fields after ``step`` (collective), or none where it is not due."""
        if not self.should_validate(step):
            return {}
        return validation_loss(trainer, self.valid_data, self.cfg, self.dp)
