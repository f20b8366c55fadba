"""The prefetch thread's plans of steps ahead (working sets at DP > 1, lazy Adam): the thread plans step s+1 only
once the training thread has begun step s, so every rank's thread plans the same steps (its collectives meet their
peers'); ``close`` waits for a plan so allowed; a training thread that skips ``begin`` gets an error, not a hang.
The collectives themselves: tests/test_multinode.py and tests/test_working_set.py (DP = 2)."""

import time
from types import SimpleNamespace

import pytest
import torch

from stem_megatron.host_tables.pipeline import PlannedPipeline


class _Tier:
    """The tier's side the prefetch thread sees, recording which steps it planned."""

    def __init__(self):
        self.steps: list[torch.Tensor] = []  # the ids of each step planned ahead

    def begin_planning_ahead(self) -> None:
        pass

    def plan_ahead(self, ids: torch.Tensor) -> None:
        self.steps.append(ids)

    def preload(self, ids: torch.Tensor) -> None:
        pass

    def fetch(self, tokens, ids, training):
        return SimpleNamespace(fetched=SimpleNamespace(stats={}))

    def planned(self, ids: torch.Tensor) -> None:
        return None

    def end_planning_ahead(self) -> None:
        self.ended = True


def _pipeline(tier: _Tier) -> PlannedPipeline:
    """A planning pipeline over ``tier`` with stand-ins for the row gradients' begin, the Adam thread and the step's
    admission, no tables."""
    return PlannedPipeline(tier, SimpleNamespace(begin=lambda ids, micro_batches, plan: None),
                           SimpleNamespace(settle=lambda: None), {}, lambda ids: None, torch.device("cpu"), 64)


def _steps(n: int):
    """One micro-batch a step; step k reads ids {k, k + 10}."""
    for k in range(1, n + 1):
        tokens = torch.tensor([[k, k + 10]])
        yield {"tokens": tokens, "labels": tokens}


def _until(condition, timeout=5.0) -> bool:
    end = time.monotonic() + timeout
    while not condition() and time.monotonic() < end:
        time.sleep(0.01)
    return condition()


def test_a_step_is_planned_only_once_the_one_before_has_begun_and_close_waits_for_that_plan():
    tier = _Tier()
    with _pipeline(tier).open(_steps(4), num_micro_batches=1) as pipeline:  # step 1: allowed from the start, released
        assert torch.equal(pipeline.announced, torch.tensor([1, 11]))
        time.sleep(0.3)
        assert len(tier.steps) == 1  # step 2's ids are read, but step 1 has not begun
        with pytest.raises(RuntimeError, match="the step before was not begun"):
            pipeline.next_ids()
        next(pipeline)  # step 1's batch, as the schedule takes it: the step begins
        assert torch.equal(pipeline.announced, torch.tensor([1, 11]))
        assert _until(lambda: len(tier.steps) == 2)
        assert torch.equal(pipeline.next_ids(), torch.tensor([2, 12]))
        pipeline.release()
        next(pipeline)  # step 2 runs: step 3 may be planned, and leaving waits for that plan
    assert [ids.tolist() for ids in tier.steps] == [[1, 11], [2, 12], [3, 13]] and tier.ended
