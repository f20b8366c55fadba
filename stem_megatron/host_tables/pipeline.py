"""The order of a training step with host tables: the prefetch thread, the Adam thread, the side streams
(docs/host_tables.md draws a step of each tier as a timeline).

``RowPipeline``, the schedule's data iterator: its prefetch thread reads a step's micro-batches, checks their ids and
announces them (``next_ids``). The training thread makes the announced rows readable (the step before's end; for the
first step, entering the pipeline) and ``release``s them; only then are they fetched (``tier.fetch``) as
``batch["stem"]``, so rows read in step s+1 reflect step s. A step begins when the schedule takes its first
micro-batch and ends in ``step``: the rows updated (``tier.update``, its later part on the Adam thread: ``RowUpdates``)
and the next step released; or, a step not applied, in ``skip``: nothing updated. A worker exception is re-raised in
the training thread with the original as its cause. With a working set the store runs a pipeline whose prefetch
thread also loads a step's rows beside the step before, before announcing it (``PreloadPipeline``), and at DP > 1
plans the step first (``PlannedPipeline``).

Collectives: every one of a step is issued on the training thread (or inside backward, by ``RowGradients``' hooks),
in one order on every rank; the prefetch thread issues only on the planning groups, the Adam thread none.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Iterator, NamedTuple, Optional

import torch

from stem_megatron.data.integrity import check_token_ids
from stem_megatron.host_tables.adam_thread import RowUpdates
from stem_megatron.host_tables.node import enter_host_thread, host_threads
from stem_megatron.host_tables.row_gradients import RowGradients
from stem_megatron.host_tables.tier import LoadsAhead, PlansAhead, Tier
from stem_megatron.host_tables.transfer import landed


class _Failed(NamedTuple):
    error: BaseException


_END = object()


class RowPipeline:
    """The schedule's data iterator over a stream's micro-batches (``open``), their rows attached as ``batch["stem"]``;
    a context manager: entering makes the first step's rows readable, leaving stops the thread and waits for this
    rank's Adam thread. ``training``: the rows feed training steps (read where the tier keeps them; each step begun at
    its first micro-batch and ended by ``step``, which counts it: ``steps_done``); False: validation, rows from the
    node's copy as the tables are now.

    The store makes its training pipeline once (``HostTableStore.pipeline``), for the tables' optimizer to end each
    step through, and opens it on each training stream; a validation stream is a pipeline of its own."""

    def __init__(self, tier: Tier, grads: RowGradients, updates: RowUpdates, counters: dict,
                 admit: Callable[[torch.Tensor], None], device: torch.device, vocab_size: int, training: bool = True):
        """``tier``: where rows are read and updated; ``grads``: the step's row gradients; ``updates``: the Adam
        thread; ``counters``: the step's counters, added to as the schedule takes each micro-batch; ``admit``: makes a
        step's rows readable where this stream reads them (training: ``tier.admit``; validation: the node's copy made
        current, ``host_tier.make_current``)."""
        self.tier, self.grads, self.updates, self.counters, self.admit = tier, grads, updates, counters, admit
        self.device, self.vocab_size, self.training = device, vocab_size, training
        self.steps_done = 0  # Adam steps applied: ``step`` counts them, ``resume`` sets a checkpoint's
        self._thread: Optional[threading.Thread] = None  # the open stream's prefetch thread; None: not open

    @property
    def is_open(self) -> bool:
        return self._thread is not None

    def open(self, data: Iterator[dict], num_micro_batches: int, depth: int = 2) -> RowPipeline:
        """Start reading ``data``, ``num_micro_batches`` a step (``depth`` micro-batches fetched ahead)."""
        if self.is_open:
            raise RuntimeError("the host tables' training stream is open already: leave its with-block before "
                               "opening another (HostTableStore.stream)")
        self.num_micro_batches = num_micro_batches
        self.announced = torch.empty(0, dtype=torch.int64)  # ids of the step ``next_ids`` last returned
        self.wait_s = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._announced: queue.Queue = queue.Queue()  # each step's ids, then _END (or _Failed)
        self._released, self._stop, self._ended = threading.Semaphore(0), threading.Event(), False
        self._micro_batches = 0  # taken by the schedule: a step begins at each multiple of ``num_micro_batches``
        self._grads: dict = {}  # layer -> the step's (ids, gradients, copy event) at their owners (``reduce_gradients``)
        self._thread = threading.Thread(target=self._work, args=(data, num_micro_batches, host_threads(self.device)),
                                        name="stem-prefetch", daemon=True)
        self._thread.start()
        return self

    def __enter__(self) -> RowPipeline:
        """The first step's rows readable, as each step readies the next (a collective: every rank enters together)."""
        try:
            self.skip()  # as a step not applied readies the next
        except BaseException as error:
            self.__exit__(type(error), error, error.__traceback__)
            raise
        return self

    def __exit__(self, kind, error, trace) -> None:
        """Stop the worker (after an error not waiting for a plan a peer may never make), then this rank's Adam
        thread: no collective on the way out of an error."""
        try:
            self._close(wait=kind is None)
        finally:
            self.updates.settle()

    def resume(self, steps_done: int) -> None:
        """Continue from a checkpoint's Adam step count."""
        self.steps_done = steps_done

    # ---- a training step (training thread) ----
    def reduce_gradients(self) -> torch.Tensor:
        """Every layer's gradients at their owners (DP-averaged); returns the squared norm of the STEM gradients summed
        over DP, TP and PP (each row counted once)."""
        self._grads, sq = self.grads.finish_grad_sync()
        return sq

    def scale_gradients(self, coef: float) -> None:
        """The clip: the step's row gradients times ``coef``."""
        for _, grads, event in self._grads.values():
            landed(event)
            grads.mul_(coef)

    def step(self, lr: float) -> None:
        """The rows updated at ``lr`` (Adam step ``steps_done + 1``), those the next step reads first, the next step's
        rows made readable where the tier reads them, the rest beside it (``RowUpdates``); then released."""
        next_ids = self.next_ids()
        self.updates.settle()  # this rank's rows and moments: no other rank writes them
        later = self.tier.update(self.steps_done + 1, lr, self._grads, next_ids)
        self.steps_done, self._grads = self.steps_done + 1, {}
        self.updates.later(later)
        self.release()

    def skip(self) -> None:
        """The step ends without an update (not finite, or ``train.skip_steps``): every row and moment as it stood, the
        next step's rows made current in the node's copy, admitted where the tier reads them (collective), released."""
        self._grads, ids = {}, self.next_ids()
        self.admit(ids)
        self.release()

    def _begin(self) -> None:
        """The announced step begins (its first micro-batch is taken): the routes of its row gradients are the tier's
        plan of it (``planned``)."""
        ids = self.announced
        self.grads.begin(ids, self.num_micro_batches, self.tier.planned(ids))

    # ---- the prefetch thread ----
    def _work(self, data, num_micro_batches, threads: int) -> None:
        try:
            enter_host_thread(threads, self.device)  # gathers and unique on an OpenMP team of its own
            step: list[dict] = []
            for batch in data:
                check_token_ids(batch["tokens"], self.vocab_size)  # before any id reaches the tables
                step.append(batch)
                if len(step) == num_micro_batches:
                    if not self._run(step):
                        return
                    step = []
            if step and not self._run(step):
                return
            self._announced.put(_END)
            self._put(_END)
        except BaseException as error:  # surfaces in the training thread
            self._announced.put(_Failed(error))
            self._put(_Failed(error))

    def _run(self, step: list[dict]) -> bool:
        """Announce a step's ids, wait for its release, fetch its rows; False once stopped."""
        ids = torch.unique(torch.cat([batch["tokens"].flatten() for batch in step]))
        if not self._announce(ids):
            return False
        while not self._released.acquire(timeout=0.1):
            if self._stop.is_set():
                return False
        for batch in step:
            batch["stem"] = self.tier.fetch(batch["tokens"], ids, training=self.training)
            self._put(batch)
        return not self._stop.is_set()

    def _announce(self, ids: torch.Tensor) -> bool:
        """(prefetch thread) The step's sorted ``ids`` handed to the training thread (``next_ids``); False once
        stopped."""
        self._announced.put(ids)
        return True

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    # ---- the training thread's side of the worker ----
    def next_ids(self) -> torch.Tensor:
        """The ids the next step reads, once the worker has read its micro-batches; empty when the data has ended."""
        if self._ended:
            return torch.empty(0, dtype=torch.int64)
        item = self._announced.get()
        if isinstance(item, _Failed):
            raise RuntimeError(f"STEM row prefetch failed: {item.error!r}") from item.error
        if item is _END:
            self._ended = True
            return torch.empty(0, dtype=torch.int64)
        self.announced = item
        return item

    def release(self) -> None:
        """The rows of the announced step are readable: let the worker fetch them."""
        self._released.release()

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        start = time.perf_counter()
        item = self._queue.get()
        self.wait_s += time.perf_counter() - start
        if item is _END:
            raise StopIteration
        if isinstance(item, _Failed):
            raise RuntimeError(f"STEM row prefetch failed: {item.error!r}") from item.error
        if self.training and self._micro_batches % self.num_micro_batches == 0:
            self._begin()
        self._micro_batches += 1
        for key, value in item["stem"].fetched.stats.items():
            self.counters[key] += value
        return item

    def take_wait_s(self) -> float:
        wait, self.wait_s = self.wait_s, 0.0
        return wait

    def _close(self, wait: bool = True) -> None:
        """Stop the worker (``wait``: the training loop ended normally, which ``PlannedPipeline`` waits on)."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._thread = None


class PreloadPipeline(RowPipeline):
    """A training pipeline over a working set (``device_tier.DeviceTier``): the prefetch thread loads a step's rows into
    the set beside the step before (``tier.preload``), then announces the step. The step before's update and the
    step's admission wait for the announcement, so they come after the load however late it runs: the same rows load
    ahead, and with dense Adam the same rows take the step before's update in their slots, on every run."""

    tier: LoadsAhead

    def _announce(self, ids: torch.Tensor) -> bool:
        self.tier.preload(ids)
        return super()._announce(ids)


class PlannedPipeline(PreloadPipeline):
    """A training pipeline over a working set at DP > 1 (``device_tier.OwnerTier``): the prefetch thread also plans each
    step before it announces it (``tier.plan_ahead``, over the planning groups), so that the rows this rank owns of it
    load beside the step before. It plans step s+1 only once the training thread has begun step s (every rank runs a
    begun step whole, so every rank's thread plans the same steps and its collectives meet their peers'); leaving the
    stream after a normal end first lets it plan the step it may."""

    tier: PlansAhead

    def open(self, data: Iterator[dict], num_micro_batches: int, depth: int = 2) -> RowPipeline:
        if not self.is_open:  # (else ``RowPipeline.open`` refuses)
            self._turns = threading.Condition()  # steps the worker may plan (the first, then one per begun step)
            self._permitted, self._planned, self._taken = 1, 0, 0  # steps: may plan, planned, announced ids taken
            self.tier.begin_planning_ahead()
        return super().open(data, num_micro_batches, depth)

    def _begin(self) -> None:
        """The announced step begins: the worker may plan the step after it."""
        with self._turns:
            self._permitted += 1
            self._turns.notify_all()
        super()._begin()

    def _announce(self, ids: torch.Tensor) -> bool:
        """Wait for the turn to plan the step (the step before begun), plan it, load its rows, announce it."""
        with self._turns:
            while self._planned >= self._permitted:
                if self._stop.is_set():
                    return False
                self._turns.wait(0.1)
        self.tier.plan_ahead(ids)
        with self._turns:
            self._planned += 1
            self._turns.notify_all()
        return super()._announce(ids)

    def next_ids(self) -> torch.Tensor:
        if not self._ended:
            with self._turns:
                if self._taken >= self._permitted:  # the worker waits for a turn that cannot come
                    raise RuntimeError("RowPipeline.next_ids: the step before was not begun (its first micro-batch "
                                       "not taken), so the prefetch thread may not plan this one")
                self._taken += 1
        return super().next_ids()

    def _close(self, wait: bool = True) -> None:
        """First let the worker plan the step it may where ``wait`` (its peers on every rank plan it too: a training
        loop that ended normally; not after an error, where a peer may never plan it); then stop it and drop the plans
        not taken."""
        if wait:
            with self._turns:
                while self._planned < self._permitted and self._thread.is_alive():
                    self._turns.wait(0.1)
        super()._close(wait)
        self.tier.end_planning_ahead()
