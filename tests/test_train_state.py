"""The train state (training/train_state.py): the steps a job trains, from the one it resumed after to its last."""

from stem_megatron.config import TrainConfig
from stem_megatron.training.train_state import TrainState


def test_a_job_trains_from_the_step_after_its_checkpoint_to_its_last_and_the_state_follows():
    state = TrainState.resuming(TrainConfig(steps=10, exit_after_steps=4), resumed=3)
    assert (state.resumed, state.last, state.step, state.stopped) == (3, 7, 3, None)
    seen = [(step, state.step) for step in state.steps()]
    assert seen == [(4, 4), (5, 5), (6, 6), (7, 7)] and state.step == 7
    assert TrainState.resuming(TrainConfig(steps=10, exit_after_steps=4), resumed=8).last == 10
    done = TrainState.resuming(TrainConfig(steps=10), resumed=10)
    assert list(done.steps()) == [] and done.step == 10  # nothing to train: the step stays the checkpoint's
