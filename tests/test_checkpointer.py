"""The run's checkpoints in the loop (training/components/checkpointer.py): saves after the steps due by
checkpoint.save_interval, the job's last step, time or a signal, once a step; a stop by a signal leaves stopped.json
and one line; a resume says where it continues and clears an earlier job's stopped.json. What a save writes:
tests/test_checkpoint.py."""

import json
import signal
from pathlib import Path

from stem_megatron.checkpoint import manager
from stem_megatron.config import RunConfig
from stem_megatron.training.components.checkpointer import Checkpointer
from stem_megatron.training.preemption import Decision
from stem_megatron.training.train_state import TrainState


def _checkpointer(tmp_path, monkeypatch, **checkpoint):
    saved = []
    monkeypatch.setattr(manager, "save", lambda cfg, trainer, detector, step: saved.append(step) or
                        Path(cfg.out_dir) / f"step_{step:06d}")
    cfg = RunConfig(out_dir=str(tmp_path))
    cfg.train.steps = 10
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    return Checkpointer(cfg, "trainer", "detector"), TrainState.resuming(cfg.train, 0), saved


def test_saves_come_by_step_time_and_signal_once_a_step_and_a_signal_stops_the_job(world_of_one, tmp_path,
                                                                                    monkeypatch, capsys):
    checkpointer, state, saved = _checkpointer(tmp_path, monkeypatch, save_interval=4)
    decisions = {3: Decision(save_due=True), 4: Decision(save_due=True), 7: Decision(stop=signal.SIGUSR1)}
    for step in state.steps():
        decided = decisions.get(step, Decision())
        if checkpointer.stops(state, decided, checkpointer.save(state, decided)):
            break
    assert saved == [3, 4, 7] and state.stopped == 7
    assert json.loads((tmp_path / "stopped.json").read_text()) == {
        "step": 7, "signal": "SIGUSR1", "checkpoint": str(tmp_path / "step_000007")}
    assert capsys.readouterr().out.splitlines()[-2:] == [
        f"saved checkpoint {tmp_path / 'step_000007'}",
        f"stopped after step 7 on SIGUSR1: checkpoint {tmp_path / 'step_000007'}; the same command resumes there"]

    checkpointer, state, saved = _checkpointer(tmp_path, monkeypatch, save_interval=4, save_interval_min=1)
    assert not checkpointer.due(state)
    state.saved_at -= 60
    assert checkpointer.due(state)  # a minute since the start: this rank's view, which the ranks agree on next
    for step in state.steps():  # a signal at the last step: saved there, and the job ends as it would anyway
        decided = Decision(stop=signal.SIGTERM) if step == 10 else Decision()
        assert not checkpointer.stops(state, decided, checkpointer.save(state, decided))
    assert saved == [4, 8, 10] and state.stopped is None and not checkpointer.due(state)  # the save reset the clock

    checkpointer, state, saved = _checkpointer(tmp_path, monkeypatch, save=False)
    state.step, decided = 5, Decision(stop=signal.SIGTERM)
    assert checkpointer.stops(state, decided, checkpointer.save(state, decided))
    assert saved == [] and json.loads((tmp_path / "stopped.json").read_text())["checkpoint"] is None
    assert capsys.readouterr().out.endswith("on SIGTERM: no checkpoint (checkpoint.save=false)\n")


def test_a_resume_says_where_it_continues_and_clears_the_stop(world_of_one, tmp_path, monkeypatch, capsys):
    checkpointer, state, _ = _checkpointer(tmp_path, monkeypatch)
    (tmp_path / "stopped.json").write_text("{}")
    monkeypatch.setattr(manager, "find", lambda cfg: None)
    assert checkpointer.resume() == 0 and not (tmp_path / "stopped.json").exists()
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(manager, "find", lambda cfg: (tmp_path / "step_000010", {"step": 10}))
    monkeypatch.setattr(manager, "load", lambda path, manifest, cfg, trainer, detector: manifest["step"])
    assert checkpointer.resume() == 10
    assert capsys.readouterr().out.splitlines() == [
        f"resumed from {tmp_path / 'step_000010'} after step 10",
        "nothing to train: the checkpoint is at step 10 of train.steps=10 (for a new run, set checkpoint.resume=false "
        "or another out_dir)"]
