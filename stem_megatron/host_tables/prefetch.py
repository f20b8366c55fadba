"""Background prefetch of STEM rows, one or more micro-batches ahead of the training step.

``RowPrefetcher`` wraps the data iterator the pipeline schedule reads. A worker thread reads one step's
micro-batches at a time, checks their ids against the vocabulary and announces them (``next_ids``): the
training thread makes the node's copy of those rows current (``store.refresh``, a collective across nodes
that only the training thread runs) and then ``release``s the step. Only then does the worker fetch the
rows (``store.fetch``) and attach them to each batch as ``batch["stem"]``, so rows read for step s+1
always reflect step s. The queue of ready micro-batches is bounded (``depth``). A worker exception is
re-raised in the training thread with the original as its cause.

With a working set at DP > 1 (lazy Adam) the worker also plans each training step as it announces it
(``store.plan_ahead``: a collective over groups only this thread issues on), so that the rows a rank owns of it load
beside the step before. It plans step s+1 only once the training thread has begun step s (``begin``): every rank
runs a begun step whole, so every rank's worker plans the same steps, and ``close`` waits for a plan so begun.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Iterator

import torch

from stem_megatron.data.integrity import check_token_ids
from stem_megatron.host_tables.node import enter_host_thread, host_threads
from stem_megatron.host_tables.store import HostTableStore


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


_END = object()


class RowPrefetcher:
    def __init__(self, data: Iterator[dict], store: HostTableStore, num_micro_batches: int, depth: int = 2,
                 training: bool = True):
        """``training``: the rows feed training steps (with a working set, read from it); False: validation."""
        self.store, self.training = store, training
        self.announced = torch.empty(0, dtype=torch.int64)  # ids of the step ``next_ids`` last returned
        self.wait_s = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._announced: queue.Queue = queue.Queue()  # each step's ids, then _END (or _Failed)
        self._released = threading.Semaphore(0)
        self._ended = False
        self._stop = threading.Event()
        self._plans = training and store.begin_planning_ahead()
        self._turns = threading.Condition()  # steps the worker may plan (the first, then one per ``begin``)
        self._permitted, self._planned, self._taken, self._over = 1, 0, 0, False  # steps: may plan, planned, taken
        self._thread = threading.Thread(target=self._work, args=(data, num_micro_batches, host_threads(store.device)),
                                        name="stem-prefetch", daemon=True)
        self._thread.start()

    def _work(self, data, num_micro_batches, threads: int) -> None:
        try:
            enter_host_thread(threads, self.store.device)  # gathers and unique on an OpenMP team of its own
            step: list[dict] = []
            for batch in data:
                check_token_ids(batch["tokens"], self.store.vocab_size)  # before any id reaches the tables
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
        finally:
            with self._turns:
                self._over = True
                self._turns.notify_all()

    def _run(self, step: list[dict]) -> bool:
        """Plan (working set, DP > 1) and announce a step's ids, wait for its release, fetch its rows; False once
        stopped."""
        ids = torch.unique(torch.cat([batch["tokens"].flatten() for batch in step]))
        rows = ids
        if self._plans:
            if not self._my_turn():
                return False
            rows = self.store.plan_ahead(ids)  # the rows this rank updates in the step
            with self._turns:
                self._planned += 1
                self._turns.notify_all()
        self._announced.put(ids)
        if self.training:
            self.store.preload(rows)  # rows entering a working set, loaded beside the step before
        while not self._released.acquire(timeout=0.1):
            if self._stop.is_set():
                return False
        for batch in step:
            batch["stem"] = self.store.fetch(batch["tokens"], ids, training=self.training)
            self._put(batch)
        return not self._stop.is_set()

    def _my_turn(self) -> bool:
        """Wait until the training thread has begun the step before the one to plan; False once stopped."""
        with self._turns:
            while self._planned >= self._permitted:
                if self._stop.is_set():
                    return False
                self._turns.wait(0.1)
        return True

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next_ids(self) -> torch.Tensor:
        """(training thread) The ids the next step reads, once the worker has read its micro-batches;
        empty when the data has ended."""
        if self._ended:
            return torch.empty(0, dtype=torch.int64)
        with self._turns:
            if self._plans and self._taken >= self._permitted:  # the worker waits for a turn that cannot come
                raise RuntimeError("RowPrefetcher.next_ids: the step before was not begun (RowPrefetcher.begin, "
                                   "which train_step calls), so the prefetch thread may not plan this one")
            self._taken += 1
        item = self._announced.get()
        if isinstance(item, _Failed):
            raise RuntimeError(f"STEM row prefetch failed: {item.error!r}") from item.error
        if item is _END:
            self._ended = True
            return torch.empty(0, dtype=torch.int64)
        self.announced = item
        return item

    def begin(self) -> torch.Tensor:
        """(training thread) The announced step begins; every rank runs it whole, so the worker may plan the step
        after it. Returns the step's ids."""
        with self._turns:
            self._permitted += 1
            self._turns.notify_all()
        return self.announced

    def release(self) -> None:
        """(training thread) The rows of the announced step are current: let the worker fetch them."""
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
        self.store.count(item["stem"].fetched.stats)
        return item

    def take_wait_s(self) -> float:
        wait, self.wait_s = self.wait_s, 0.0
        return wait

    def close(self, wait: bool = True) -> None:
        """Stop the worker; ``wait``: first let it plan the step it may (its peers on every rank plan it too: a
        training loop that ended normally). Not after an error, where a peer may never plan it."""
        if self._plans and wait:
            with self._turns:
                while self._planned < self._permitted and not self._over:
                    self._turns.wait(0.1)
        self._stop.set()
        self._thread.join(timeout=5)
        if self._plans:
            self.store.end_planning_ahead()
