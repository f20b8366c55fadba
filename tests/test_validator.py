"""Validation in the loop (training/components/validator.py): at every train.eval_interval and the last step, never
with train.eval_iters=0, and a split too small for it refused before the model is built."""

import pytest

from stem_megatron.config import RunConfig
from stem_megatron.training.components import validator as module
from stem_megatron.training.components.validator import Validator


def _cfg(eval_iters, eval_interval):
    cfg = RunConfig()
    cfg.train.steps, cfg.train.global_batch_size = 7, 4
    cfg.train.eval_iters, cfg.train.eval_interval = eval_iters, eval_interval
    return cfg


@pytest.mark.parametrize("eval_iters,eval_interval,steps", [(2, 3, [3, 6, 7]), (2, 0, [7]), (0, 3, [])])
def test_validation_comes_at_its_steps_into_the_record(monkeypatch, eval_iters, eval_interval, steps):
    calls = []
    monkeypatch.setattr(module, "validation_loss", lambda trainer, data, cfg, dp: calls.append(trainer) or
                        {"valid_loss": 1.5, "valid_ppl": 4.5})
    validator = Validator(_cfg(eval_iters, eval_interval), list(range(8)), dp=1)
    fields = {step: validator.validate("trainer", step) for step in range(1, 8)}
    assert [step for step, f in fields.items() if f] == steps and len(calls) == len(steps)
    assert all(f == {"valid_loss": 1.5, "valid_ppl": 4.5} for f in fields.values() if f)


def test_a_validation_split_too_small_is_refused_at_once():
    with pytest.raises(ValueError, match="validation needs train.eval_iters \\* train.global_batch_size = 8 samples"):
        Validator(_cfg(2, 3), list(range(7)), dp=1)
    Validator(_cfg(0, 3), None, dp=1)  # no validation: no split needed
