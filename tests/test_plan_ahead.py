"""The prefetch thread's plans of steps ahead (working sets at DP > 1, lazy Adam): the thread plans step s+1 only
once the training thread has begun step s, so every rank's thread plans the same steps (its collectives meet their
peers'); ``close`` waits for a plan so allowed; a training thread that skips ``begin`` gets an error, not a hang.
The collectives themselves: tests/test_multinode.py and tests/test_working_set.py (DP = 2)."""

import time
from types import SimpleNamespace

import pytest
import torch

from stem_megatron.host_tables.prefetch import RowPrefetcher


class _Store:
    """The store's side the prefetch thread sees, recording which steps it planned."""

    device, vocab_size = torch.device("cpu"), 64

    def __init__(self):
        self.planned: list[torch.Tensor] = []

    def begin_planning_ahead(self) -> bool:
        return True

    def plan_ahead(self, ids: torch.Tensor) -> torch.Tensor:
        self.planned.append(ids)
        return ids

    def preload(self, ids: torch.Tensor) -> None:
        pass

    def fetch(self, tokens, ids, training):
        return SimpleNamespace(fetched=SimpleNamespace(stats={}))

    def count(self, stats: dict) -> None:
        pass

    def end_planning_ahead(self) -> None:
        self.ended = True


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
    store = _Store()
    prefetcher = RowPrefetcher(_steps(4), store, num_micro_batches=1)
    assert torch.equal(prefetcher.next_ids(), torch.tensor([1, 11]))  # step 1: allowed from the start
    prefetcher.release()
    next(prefetcher)  # step 1's batch, as the schedule takes it
    time.sleep(0.3)
    assert len(store.planned) == 1  # step 2's ids are read, but step 1 has not begun
    with pytest.raises(RuntimeError, match="the step before was not begun"):
        prefetcher.next_ids()
    assert torch.equal(prefetcher.begin(), torch.tensor([1, 11]))
    assert _until(lambda: len(store.planned) == 2)
    assert torch.equal(prefetcher.next_ids(), torch.tensor([2, 12]))
    prefetcher.release()
    prefetcher.begin()  # step 2 runs: step 3 may be planned, and close waits for that plan
    next(prefetcher)
    prefetcher.close()
    assert [ids.tolist() for ids in store.planned] == [[1, 11], [2, 12], [3, 13]] and store.ended

