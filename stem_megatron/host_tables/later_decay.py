"""Dense Adam's decay of the rows outside a working set, beside the next step, first the rows a preload asks for.

With the recipe's dense Adam every row changes every step: a row outside the working set decays on the host (a zero
gradient) and ``ResidentRows._step_resident`` leaves most of that to the Adam thread, beside the next step. A row the
step after reads can load into the set ahead, during the next step (``WorkingSet.preload``), only once its decay of
the step before is done. Run in one piece, that decay (every row a rank owns, 126 GB of passes a step at 1B on one
GPU by docs/gpu_step_v2.md) ends about when the next step does, too late to load anything ahead. So it runs in
chunks, and between chunks the prefetch thread's rows go first (``wait_for``); each row is decayed once, by the same
kernel as in one piece (elementwise: bitwise the same values).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch

CHUNK_ELEMENTS = 1 << 24  # a chunk's elements over the layers, what an asker may wait for (~30 ms at 1B: gpu_step_v2)


class LaterDecay:
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
