"""Background prefetch of STEM rows, one or more micro-batches ahead of the training step.

``RowPrefetcher`` wraps the data iterator the pipeline schedule reads. A worker thread reads one step's
micro-batches at a time, checks their ids against the vocabulary and announces them (``next_ids``): the
training thread makes the node's copy of those rows current (``store.refresh``, a collective across nodes
that only the training thread runs) and then ``release``s the step. Only then does the worker fetch the
rows (``store.fetch``) and attach them to each batch as ``batch["stem"]``, so rows read for step s+1
always reflect step s. The queue of ready micro-batches is bounded (``depth``). A worker exception is
re-raised in the training thread with the original as its cause.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Iterator

import torch

from stem_megatron.data.integrity import check_token_ids
from stem_megatron.host_tables.node import host_threads
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
        self._thread = threading.Thread(target=self._work, args=(data, num_micro_batches, host_threads(store.device)),
                                        name="stem-prefetch", daemon=True)
        self._thread.start()

    def _work(self, data, num_micro_batches, threads: int) -> None:
        try:
            torch.set_num_threads(threads)  # gathers and unique run on this thread's own OpenMP team
            if self.store.device.type == "cuda":  # a new thread starts on GPU 0: use this rank's device
                torch.cuda.set_device(self.store.device)
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

    def _run(self, step: list[dict]) -> bool:
        """Announce a step's ids, wait for its release, fetch its rows; False once stopped."""
        ids = torch.unique(torch.cat([batch["tokens"].flatten() for batch in step]))
        self._announced.put(ids)
        if self.training:
            self.store.preload(ids)  # rows entering a working set, loaded beside the step before
        while not self._released.acquire(timeout=0.1):
            if self._stop.is_set():
                return False
        for batch in step:
            batch["stem"] = self.store.fetch(batch["tokens"], ids, training=self.training)
            self._put(batch)
        return not self._stop.is_set()

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
        item = self._announced.get()
        if isinstance(item, _Failed):
            raise RuntimeError(f"STEM row prefetch failed: {item.error!r}") from item.error
        if item is _END:
            self._ended = True
            return torch.empty(0, dtype=torch.int64)
        self.announced = item
        return item

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

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
