"""A training step's STEM rows after the forward: gradients out of the device, CPU Adam in next-use order.

Gradients out (``RowGradients``). As soon as backward fills a micro-batch's compact row gradient (its
distinct ids x this rank's columns), it is added into one fp32 buffer per layer over the step's distinct
ids (announced by the prefetcher) and the micro-batch's rows are let go: the device holds the rows of the
micro-batches in flight and the step's merged gradients, not every micro-batch's rows until the step
ends. A row's micro-batch gradients are added in micro-batch order, as one ``index_add_`` over all of them
did. Where each of the step's rows goes is settled when the step begins (``RowExchange.plan``, on the host);
once a layer's last micro-batch is in, the layer goes to its owners (``RowExchange.to_owners``, averaged over
DP) and the rows this rank updates land in reusable pinned host buffers on a side stream
(``pinned.DeviceToHost``): from the backward hook itself (``stem.overlap_exchange``) while backward goes on
through the earlier layers, else after backward. The hook runs where backward runs (the training thread, or on
GPU autograd's device thread while the training thread waits in ``backward``), and every rank of an exchange
group finishes its layers in one order, so the exchange's collectives take one place among the step's others
on every rank: no collective comes from a thread of its own (NCCL would hang on two ranks' different
interleavings; ``logging.collective_audit`` checks it).

Update order (``RowUpdates``). CPU Adam cannot start before the clipping norm, which needs every layer's
gradients. It then runs in two parts, both on a thread of its own with the node's cores: first the rows
any rank of the DP group reads in the next step (its announced ids and hot-row cache), which the training
thread waits for, after which those rows are pulled across nodes and the prefetcher fetches them; then the
rest (``stem.overlap_update``), while the next step's forward and backward run. The next update, and whatever reads the tables whole (checkpoints,
export, validation), waits for it first. Adam is per row, so the order changes no bit: rows read in step
s+1 reflect step s exactly as in the serial order.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from stem_megatron.host_tables.exchange import Route, RowExchange
from stem_megatron.host_tables.node import enter_host_thread
from stem_megatron.host_tables.pinned import DeviceToHost

Landed = tuple[torch.Tensor, torch.Tensor, Optional[torch.cuda.Event]]  # (ids, gradients, their copy's end)


class RowGradients:
    """Per STEM layer, the step's row gradients: merged on the device, exchanged, landed on the host."""

    def __init__(self, layers: list[int], cols: int, exchange: RowExchange, dp_group, device: torch.device,
                 overlap: bool, landing_rows: int = 0, to_host: bool = True):
        """``landing_rows``: the most rows this rank updates in a step (``pinned.landing_rows``), whose pinned
        landing buffers are reserved here (GPU). ``to_host``: False where the rows are updated on the device (a
        working set): the gradients stay there."""
        self.layers, self.cols, self.exchange, self.dp_group, self.device = layers, cols, exchange, dp_group, device
        self.overlap, self.to_host = overlap, to_host
        self.d2h = DeviceToHost(device)
        for layer in layers if to_host else ():
            self.d2h.reserve(layer, landing_rows * cols * 4)
        self.stats = self.new_stats()
        self._routes: Optional[list[Route]] = None  # the step's rows on their way to the owners; None: no step
        self._owned = torch.empty(0, dtype=torch.int64)  # the sorted ids this rank updates in the step
        self._size = self._micro_batches = 0  # the step's distinct ids, its micro-batches
        self._merged: dict[int, torch.Tensor] = {}  # layer -> [step's distinct ids, cols] fp32 on the device
        self._filled = dict.fromkeys(layers, 0)
        self._sent: dict[int, tuple[Landed, torch.Tensor]] = {}  # layers sent from backward
        self._held = 0  # device bytes of registered rows and merged gradients

    @staticmethod
    def new_stats() -> dict:
        """``device_row_bytes_peak``: the most device bytes the step held in row leaves registered by the
        forward and not yet merged, their gradient being merged and the merged buffers (the memory plan's
        ``step_rows`` less the prefetcher's queue). ``exchange_wait_s``: the step's wait after backward for
        layers not sent during it."""
        return dict(bytes_from_device=0, layers_sent_in_backward=0, exchange_wait_s=0.0, device_row_bytes_peak=0)

    def _hold(self, nbytes: int, transient: int = 0) -> None:
        self._held += nbytes
        self.stats["device_row_bytes_peak"] = max(self.stats["device_row_bytes_peak"], self._held + transient)

    def begin(self, ids: torch.Tensor, micro_batches: int, plan: Optional[tuple[list[Route], torch.Tensor]] = None
              ) -> None:
        """A step of ``micro_batches`` reading the sorted distinct ``ids`` starts: its routes to the owners are
        settled here, on the training thread (a collective over the exchange groups' gloo twins), unless the
        ``plan`` of these ids (``RowExchange.plan``) was made already (a working set plans the step ahead)."""
        self._routes, self._owned = plan if plan is not None else self.exchange.plan(ids)
        self._size, self._micro_batches = ids.numel(), micro_batches
        self._filled = dict.fromkeys(self.layers, 0)

    def track(self, layer: int, in_step: Optional[torch.Tensor], rows: torch.Tensor) -> None:
        """(forward) Merge ``rows.grad`` into the step's buffer of ``layer`` when backward fills it;
        ``in_step``: positions of the rows' ids among the step's ids, on the device."""
        if self._routes is None or in_step is None:
            raise RuntimeError("STEM rows were registered outside a step: call store.begin_step(micro_batches, "
                               "step_ids) first and fetch with the step's ids (RowPrefetcher does both)")
        rows.register_post_accumulate_grad_hook(functools.partial(self._merge, layer, in_step))
        self._hold(rows.numel() * rows.element_size())

    def _merge(self, layer: int, in_step: torch.Tensor, rows: torch.Tensor) -> None:
        """Backward hook: add a micro-batch's gradient, free its rows; after the step's last, send the layer."""
        merged = self._merged.get(layer)
        if merged is None:
            merged = self._merged[layer] = torch.zeros(self._size, self.cols, device=self.device)
            self._hold(merged.numel() * 4)
        self._hold(0, transient=rows.grad.numel() * 4)
        merged.index_add_(0, in_step, rows.grad)
        rows.grad = None
        self._hold(-rows.numel() * rows.element_size())  # autograd lets the leaf go with the micro-batch
        self._filled[layer] += 1
        if self.overlap and self._filled[layer] == self._micro_batches:
            self._sent[layer] = self._send(layer)

    def _send(self, layer: int) -> tuple[Landed, torch.Tensor]:
        """Send layer ``layer``'s merged gradients to their owners; returns (the ids this rank updates and
        their DP-averaged gradients, landing on the host; the squared norm of those rows, on the device)."""
        merged = self._merged.pop(layer, None)
        if merged is None:
            raise RuntimeError(f"STEM layer {layer} got no row gradients this step: every micro-batch's backward "
                               f"must reach it before store.reduce_gradients()")
        self._hold(-merged.numel() * 4)
        summed = self.exchange.to_owners(self._routes, merged)
        summed /= dist.get_world_size(self.dp_group)
        if not self.to_host:
            return (self._owned, summed, None), summed.pow(2).sum()
        self.stats["bytes_from_device"] += summed.numel() * 4
        host_grads, landed = self.d2h.copy(summed, layer)  # store.step is done with it before the next step's land
        return (self._owned, host_grads, landed), summed.pow(2).sum()

    def reduce(self) -> tuple[dict[int, Landed], torch.Tensor]:
        """Every layer's gradients at their owners, those sent during backward first; returns them and the
        squared norm of the STEM gradients summed over DP, TP and PP (each row counted once)."""
        start = time.perf_counter()
        self.stats["layers_sent_in_backward"] += len(self._sent)
        out, sq = {}, torch.zeros((), dtype=torch.float32, device=self.device)
        for layer in self.layers:
            out[layer], layer_sq = self._sent.pop(layer) if layer in self._sent else self._send(layer)
            sq += layer_sq
        self._routes = None
        self.stats["exchange_wait_s"] += time.perf_counter() - start
        dist.all_reduce(sq, group=self.dp_group)
        dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
        return out, sq


class RowUpdates:
    """Runs a step's CPU Adam in two parts on one "stem-adam" thread: ``now`` waits for its part, ``later``
    (with ``overlapped``; else it waits too) returns at once and ``settle`` waits for it. The thread runs
    the kernel with ``threads`` OpenMP threads of its own, whatever the training thread's count, on ``device``
    (it waits for copies from it)."""

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
            self.now(work)
        else:
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
