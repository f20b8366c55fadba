"""Background prefetch of STEM rows, one or more micro-batches ahead of the training step.

``RowPrefetcher`` wraps the data iterator the pipeline schedule reads. A worker thread takes the next
micro-batches, checks their ids against the vocabulary, deduplicates them (``unique`` + inverse) and
asks the store for the rows, which it attaches to the batch as ``batch["stem"]``. The queue is
bounded (``depth``). Before fetching for step s the worker waits until the store has applied step
s-1's update, so prefetching never reads stale rows. A worker exception is re-raised in the training
thread with the original as its cause.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from stem_megatron.data.batches import check_token_ids
from stem_megatron.stem.store import HostTableStore
from stem_megatron.stem.transfer import Fetched


@dataclass
class PrefetchedRows:
    """What a host-resident STEM layer needs for one micro-batch."""

    uniq: torch.Tensor  # sorted unique token ids
    inverse: torch.Tensor  # [b, s]: position of each token's id in ``uniq``
    fetched: Fetched


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


_END = object()


class RowPrefetcher:
    def __init__(self, data: Iterator[dict], store: HostTableStore, num_micro_batches: int, vocab_size: int,
                 depth: int = 2, start_step: int = 0):
        self.store = store
        self.wait_s = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(data, num_micro_batches, vocab_size, start_step),
                                        name="stem-prefetch", daemon=True)
        self._thread.start()

    def _work(self, data, num_micro_batches, vocab_size, start_step) -> None:
        try:
            for i, batch in enumerate(data):
                self.store.wait_for_step(start_step + i // num_micro_batches, self._stop)
                if self._stop.is_set():
                    return
                tokens = batch["tokens"]
                check_token_ids(tokens, vocab_size)  # before any row lookup
                uniq, inverse, counts = torch.unique(tokens.cpu(), return_inverse=True, return_counts=True)
                inverse = inverse.to(self.store.device, non_blocking=True)
                batch["stem"] = PrefetchedRows(uniq, inverse, self.store.fetch(uniq, counts))
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
