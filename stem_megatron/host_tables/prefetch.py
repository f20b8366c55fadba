"""Background prefetch of STEM rows, one or more micro-batches ahead of the training step.

``RowPrefetcher`` wraps the data iterator the pipeline schedule reads. A worker thread takes the next
micro-batches and asks the store for their rows (``store.fetch``: ids checked against the vocabulary,
deduplicated, gathered), which it attaches to the batch as ``batch["stem"]``. The queue is
bounded (``depth``). Before fetching for step s the worker waits until the store has applied step
s-1's update, so prefetching never reads stale rows. A worker exception is re-raised in the training
thread with the original as its cause.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Iterator

import torch

from stem_megatron.host_tables.store import HostTableStore


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


_END = object()


class RowPrefetcher:
    def __init__(self, data: Iterator[dict], store: HostTableStore, num_micro_batches: int, depth: int = 2,
                 start_step: int = 0):
        self.store = store
        self.wait_s = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(data, num_micro_batches, start_step),
                                        name="stem-prefetch", daemon=True)
        self._thread.start()

    def _work(self, data, num_micro_batches, start_step) -> None:
        try:
            if self.store.device.type == "cuda":  # a new thread starts on GPU 0: use this rank's device
                torch.cuda.set_device(self.store.device)
            for i, batch in enumerate(data):
                self.store.wait_for_step(start_step + i // num_micro_batches, self._stop)
                if self._stop.is_set():
                    return
                batch["stem"] = self.store.fetch(batch["tokens"])  # checks the ids before any lookup
                self._put(batch)
            self._put(_END)
        except BaseException as error:  # surfaces in the training thread
            self._put(_Failed(error))

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

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
        self.store.wake_waiters()  # a worker may be waiting for a step that will not come
        self._thread.join(timeout=5)
