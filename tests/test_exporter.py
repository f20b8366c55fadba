"""The export in the loop (training/components/exporter.py): once, by the job that trains the run's last step."""

import pytest

from stem_megatron.config import RunConfig
from stem_megatron.training.components import exporter as module
from stem_megatron.training.components.exporter import Exporter
from stem_megatron.training.train_state import TrainState


@pytest.mark.parametrize("resumed,exit_after,stopped,export,exported", [
    (0, None, None, "out", True),  # the whole run in one job
    (6, None, None, "out", True),  # the job that resumed and trains the last step
    (0, 6, None, "out", False),  # a job that ends sooner (train.exit_after_steps)
    (0, None, 5, "out", False),  # a job a signal stopped
    (10, None, None, "out", False),  # a job that resumed at the end: exported already
    (0, None, None, None, False),  # no checkpoint.export
])
def test_the_job_that_trains_the_last_step_exports(tmp_path, monkeypatch, resumed, exit_after, stopped, export,
                                                     exported):
    calls = []
    monkeypatch.setattr(module, "export", lambda cfg, trainer, where, tokenizer: calls.append((where, tokenizer)))
    cfg = RunConfig()
    cfg.train.steps, cfg.train.exit_after_steps = 10, exit_after
    cfg.data.dir, cfg.checkpoint.export = str(tmp_path), export and str(tmp_path / export)
    (tmp_path / "tokenizer.json").write_text("{}")
    state = TrainState.resuming(cfg.train, resumed)
    for step in state.steps():
        if step == stopped:
            state.stopped = step
            break
    Exporter(cfg, "trainer").export(state)
    assert calls == ([(tmp_path / "out", tmp_path / "tokenizer.json")] if exported else [])
