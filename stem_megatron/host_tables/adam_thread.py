"""What runs on this rank's Adam thread ("stem-adam") and when: a step's CPU Adam in two parts (``RowUpdates``) and,
with dense Adam and a working set, the decay of the rows outside the set beside the next step (``LaterDecay``), rows
that enter the set before their decay ran taking it in their slots (``MissedUpdate``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple, Optional

import torch

from stem_megatron.host_tables.counters import Counted
from stem_megatron.host_tables.node import enter_host_thread


class RowUpdates(Counted):
    """Runs a step's CPU Adam in two parts on one "stem-adam" thread: ``now`` waits for its part, ``later`` (with
    ``overlapped``; else it waits too) returns at once and ``settle`` waits for it. The thread runs the kernel with
    ``threads`` OpenMP threads of its own, whatever the training thread's count, on ``device`` (it waits for copies
    from it)."""

    def __init__(self, overlap: bool, threads: int, device: torch.device):
        self.overlapped = overlap
        self._thread = ThreadPoolExecutor(1, "stem-adam", enter_host_thread, (threads, device))
        self._pending: Optional[Future] = None
        self.stats = self.new_stats()

    @staticmethod
    def new_stats() -> dict:
        """CPU Adam seconds the training thread waited for, seconds of the last step's later part that ran
        beside this step, and seconds this step waited for it."""
        return dict(cpu_adam_s=0.0, cpu_adam_overlapped_s=0.0, adam_wait_s=0.0)

    def now(self, work: Callable[[], None]) -> None:
        self.settle()
        self.stats["cpu_adam_s"] += self._thread.submit(_timed, work).result()

    def later(self, work: Callable[[], None]) -> None:
        if not self.overlapped:
            return self.now(work)
        self.settle()
        self._pending = self._thread.submit(_timed, work)

    def settle(self) -> None:
        """Wait for the background part (re-raising its error here)."""
        if self._pending is None:
            return
        start = time.perf_counter()
        pending, self._pending = self._pending, None
        self.stats["cpu_adam_overlapped_s"] += pending.result()
        self.stats["adam_wait_s"] += time.perf_counter() - start


def _timed(work: Callable[[], None]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


class MissedUpdate(NamedTuple):
    """(dense Adam) The update that a step's entering rows, outside the set then, missed: its ``step`` and ``lr``,
    and ``on_host``, the host's zero-gradient update of sorted ids."""
    step: int
    lr: float
    on_host: Callable[[torch.Tensor], None]


# Dense Adam's decay of the rows outside a working set, beside the next step. A row the step after reads can load
# into the set ahead (``WorkingSet.preload``) only once its decay of the step before is done; run in one piece, that
# decay (every row a rank owns: 126 GB of passes a step at 1B on one GPU, docs/gpu_step_v2.md) ends about when the
# next step does, too late to load anything ahead. So it runs in chunks, the prefetch thread's rows first; each row is
# decayed once, by the same elementwise kernel: bitwise the values of one piece.
CHUNK_ELEMENTS = 1 << 24  # a chunk's elements over the layers, what an asker may wait for (~30 ms at 1B: gpu_step_v2)


class LaterDecay(Counted):
    """The rows whose decay is due (``expect``, training thread), run on the Adam thread (``run``) while the
    prefetch thread waits for the ones it reads (``wait_for``)."""

    def __init__(self, vocab_size: int, row_elements: int):
        """``row_elements``: a row's elements over every layer decayed together (columns x layers)."""
        self.chunk = max(1, CHUNK_ELEMENTS // max(1, row_elements))
        self._due = torch.zeros(vocab_size, dtype=torch.bool)  # rows expected and not yet decayed
        self._asked = torch.empty(0, dtype=torch.int64)
        self._failed = False
        self._changed = threading.Condition()
        self.stats = self.new_stats()

    @staticmethod
    def new_stats() -> dict:
        """Rows whose decay the prefetch thread asked for (ahead of their turn) and its seconds waiting for them."""
        return dict(decay_rows_asked=0, decay_wait_s=0.0)

    def expect(self, ids: torch.Tensor) -> None:
        """(training thread, before queueing ``run``) ``ids`` are due: a ``wait_for`` them waits for their decay."""
        with self._changed:
            self._due[ids] = True
            self._failed = False

    def run(self, ids: torch.Tensor, decay: Callable[[torch.Tensor], None]) -> None:
        """(Adam thread) ``decay`` the sorted ``ids`` (expected) in chunks, asked rows first."""
        done = 0
        try:
            while True:
                with self._changed:
                    asked, self._asked = self._asked, torch.empty(0, dtype=torch.int64)
                    chunk = torch.unique(asked[self._due[asked]])
                    while not chunk.numel() and done < ids.numel():  # the next chunk, less rows asked earlier
                        chunk = ids[done:done + self.chunk]
                        chunk, done = chunk[self._due[chunk]], done + self.chunk
                if not chunk.numel():
                    return
                decay(chunk)
                with self._changed:
                    self._due[chunk] = False
                    self._changed.notify_all()
        except BaseException:
            with self._changed:
                self._failed = True
                self._due.fill_(False)
                self._changed.notify_all()
            raise

    def wait_for(self, ids: torch.Tensor) -> None:
        """(prefetch thread) Until none of ``ids`` is due, those asked for decaying next; raises where ``run``
        failed (its error reaches the training thread too)."""
        with self._changed:
            due = ids[self._due[ids]]
            if not due.numel():
                return
            start = time.perf_counter()
            self._asked = torch.cat([self._asked, due])
            self.stats["decay_rows_asked"] += due.numel()
            while self._due[due].any():
                self._changed.wait()
            self.stats["decay_wait_s"] += time.perf_counter() - start
            if self._failed:
                raise RuntimeError("the dense decay of the step before failed on the Adam thread (its error is "
                                   "raised in the training thread)")
