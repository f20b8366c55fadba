"""The order of a training step with host tables: the prefetch thread, the Adam thread, the side streams
(docs/host_tables.md draws a step of each tier as a timeline).

``RowPipeline``, the schedule's data iterator: its prefetch thread reads a step's micro-batches, checks their ids and
announces them (``next_ids``); with a working set at DP > 1 it plans the step too (``tier.plan_ahead``, on groups only
it issues on, once the step before has begun) and loads the rows it owns beside the step before (``tier.preload``).
The training thread makes the announced rows readable (the step before's end; for the first step, entering the
pipeline) and ``release``s them; only then are they fetched (``tier.fetch``) as ``batch["stem"]``, so rows read in
step s+1 reflect step s. A step begins when the schedule takes its first micro-batch and ends in ``step``: the rows
updated (``tier.update``, its later part on the Adam thread: ``RowUpdates``) and the next step released; or, a step not
applied, in ``skip``: nothing updated. A worker exception is re-raised in the training thread with the original as its
cause.

Collectives: every one of a step is issued on the training thread (or inside backward, by ``RowGradients``' hooks),
in one order on every rank; the prefetch thread issues only on the planning groups, the Adam thread none.

``RowGradients`` (megatron DDP's names, a layer its bucket): as backward fills a micro-batch's compact row gradient it
is added into one fp32 buffer per layer over the step's distinct ids (in micro-batch order) and the micro-batch's rows
are let go (``_register_grad_ready``). Once a layer's last micro-batch is in, the layer goes to its owners
(``_start_grad_sync``: ``RowExchange.to_owners``, averaged over DP) and, for the host tier, lands in pinned host buffers
on a side stream: from the hook itself (``host_tables.overlap_exchange``), else after backward (``finish_grad_sync``).
Every rank finishes its layers in one order, so the exchange takes one place among the step's collectives on every rank.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator, NamedTuple, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from stem_megatron.data.integrity import check_token_ids
from stem_megatron.host_tables.exchange import Route, RowExchange
from stem_megatron.host_tables.node import enter_host_thread, host_threads
from stem_megatron.host_tables.transfer import DeviceToHost, landed

Landed = tuple[torch.Tensor, torch.Tensor, Optional[torch.cuda.Event]]  # (ids, gradients, their copy's end)


class RowGradients:
    """Per STEM layer, the step's row gradients: merged on the device, exchanged, landed on the host."""

    def __init__(self, layers: list[int], cols: int, exchange: RowExchange, dp_group, device: torch.device,
                 overlap: bool, landing_rows: int = 0, to_host: bool = True):
        """``landing_rows``: the most rows this rank updates in a step (``transfer.landing_rows``), whose pinned
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
            raise RuntimeError("STEM rows were read outside a training step: read the batches through "
                               "HostTableStore.stream, which begins each step and fetches it with its ids")
        rows.register_post_accumulate_grad_hook(functools.partial(self._register_grad_ready, layer, in_step))
        self._hold(rows.numel() * rows.element_size())

    def _register_grad_ready(self, layer: int, in_step: torch.Tensor, rows: torch.Tensor) -> None:
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
            self._sent[layer] = self._start_grad_sync(layer)

    def _start_grad_sync(self, layer: int) -> tuple[Landed, torch.Tensor]:
        """Send layer ``layer``'s merged gradients to their owners; returns (the ids this rank updates and
        their DP-averaged gradients, landing on the host; the squared norm of those rows, on the device)."""
        merged = self._merged.pop(layer, None)
        if merged is None:
            raise RuntimeError(f"STEM layer {layer} got no row gradients this step: every micro-batch's backward "
                               f"must reach it before RowPipeline.reduce_gradients()")
        self._hold(-merged.numel() * 4)
        summed = self.exchange.to_owners(self._routes, merged)
        summed /= dist.get_world_size(self.dp_group)
        if not self.to_host:
            return (self._owned, summed, None), summed.pow(2).sum()
        self.stats["bytes_from_device"] += summed.numel() * 4
        host_grads, landed = self.d2h.copy(summed, layer)  # the update is done with it before the next step's land
        return (self._owned, host_grads, landed), summed.pow(2).sum()

    def finish_grad_sync(self) -> tuple[dict[int, Landed], torch.Tensor]:
        """Every layer's gradients at their owners, those sent during backward first; returns them and the
        squared norm of the STEM gradients summed over DP, TP and PP (each row counted once)."""
        start = time.perf_counter()
        self.stats["layers_sent_in_backward"] += len(self._sent)
        out, sq = {}, torch.zeros((), dtype=torch.float32, device=self.device)
        for layer in self.layers:
            out[layer], layer_sq = self._sent.pop(layer) if layer in self._sent else self._start_grad_sync(layer)
            sq += layer_sq
        self._routes = None
        self.stats["exchange_wait_s"] += time.perf_counter() - start
        dist.all_reduce(sq, group=self.dp_group)
        dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
        return out, sq


class RowUpdates:
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


class _Failed(NamedTuple):
    error: BaseException


_END = object()


class RowPipeline:
    """The schedule's data iterator over ``data``'s micro-batches, ``num_micro_batches`` a step, their rows attached
    as ``batch["stem"]``; a context manager: entering makes the first step's rows readable, leaving stops the thread
    and waits for this rank's Adam thread. ``training``: the rows feed training steps (read where the tier keeps
    them; each step begun at its first micro-batch and ended by ``step``); False: validation, rows from the node's
    copy as the tables are now."""

    def __init__(self, data: Iterator[dict], store, num_micro_batches: int, depth: int = 2, training: bool = True):
        self.store, self.tier, self.training = store, store.tier, training
        self.num_micro_batches = num_micro_batches
        self.announced = torch.empty(0, dtype=torch.int64)  # ids of the step ``next_ids`` last returned
        self.wait_s = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._announced: queue.Queue = queue.Queue()  # each step's ids, then _END (or _Failed)
        self._released, self._stop, self._ended = threading.Semaphore(0), threading.Event(), False
        self._plans = training and self.tier.begin_planning_ahead()
        self._turns = threading.Condition()  # steps the worker may plan (the first, then one per begun step)
        self._permitted, self._planned, self._taken, self._over = 1, 0, 0, False  # steps: may plan, planned, taken
        self._micro_batches = 0  # taken by the schedule: a step begins at each multiple of ``num_micro_batches``
        self._grads: dict = {}  # layer -> the step's (ids, gradients, copy event) at their owners (``reduce_gradients``)
        self._thread = threading.Thread(target=self._work, args=(data, num_micro_batches, host_threads(store.device)),
                                        name="stem-prefetch", daemon=True)
        self._thread.start()

    def __enter__(self) -> RowPipeline:
        """The first step's rows readable, as each step readies the next (a collective: every rank enters together)."""
        try:
            self.skip()  # as a step not applied readies the next
        except BaseException as error:
            self.__exit__(type(error), error, error.__traceback__)
            raise
        if self.training:
            self.store.pipeline = self  # the step's end, for the tables' optimizer (training/table_optimizer.py)
        return self

    def __exit__(self, kind, error, trace) -> None:
        """Stop the worker (after an error not waiting for a plan a peer may never make), then this rank's Adam
        thread: no collective on the way out of an error."""
        self.store.pipeline = None if self.store.pipeline is self else self.store.pipeline
        try:
            self._close(wait=kind is None)
        finally:
            self.store.updates.settle()

    # ---- a training step (training thread) ----
    def reduce_gradients(self) -> torch.Tensor:
        """Every layer's gradients at their owners (DP-averaged); returns the squared norm of the STEM gradients summed
        over DP, TP and PP (each row counted once)."""
        self._grads, sq = self.store.grads.finish_grad_sync()
        return sq

    def scale_gradients(self, coef: float) -> None:
        """The clip: the step's row gradients times ``coef``."""
        for _, grads, event in self._grads.values():
            landed(event)
            grads.mul_(coef)

    def step(self, lr: float) -> None:
        """The rows updated at ``lr`` (the Adam step after the store's last), those the next step reads first, the
        next step's rows made readable where the tier reads them, the rest beside it (``RowUpdates``); then released."""
        next_ids, store = self.next_ids(), self.store
        store.updates.settle()  # this rank's rows and moments: no other rank writes them
        step = store.steps_done + 1
        later = self.tier.update(step, lr, self._grads, next_ids)
        store.steps_done, self._grads = step, {}
        store.updates.later(later)
        self.release()

    def skip(self) -> None:
        """The step ends without an update (not finite, or ``train.skip_steps``): every row and moment as it was, the
        next step's rows made current in the node's copy, admitted where the tier reads them (collective), released."""
        self._grads, ids = {}, self.next_ids()
        self.store.refresh(ids)
        if self.training:
            self.tier.admit(ids)
        self.release()

    def _begin(self) -> None:
        """The announced step begins (its first micro-batch is taken): every rank runs it whole, so the worker may plan
        the step after it; the routes of its row gradients are settled (those the tier planned, else here)."""
        with self._turns:
            self._permitted += 1
            self._turns.notify_all()
        ids = self.announced
        self.store.grads.begin(ids, self.num_micro_batches, self.tier.planned(ids))

    # ---- the prefetch thread ----
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
        """Plan (ahead, where the tier does) and announce a step's ids, preload its rows, wait for its release, fetch
        its rows; False once stopped."""
        ids = torch.unique(torch.cat([batch["tokens"].flatten() for batch in step]))
        rows = ids
        if self._plans:
            if not self._my_turn():
                return False
            rows = self.tier.plan_ahead(ids)  # the rows this rank updates in the step
            with self._turns:
                self._planned += 1
                self._turns.notify_all()
        self._announced.put(ids)
        if self.training:
            self.tier.preload(rows)  # rows entering a working set, loaded beside the step before
        while not self._released.acquire(timeout=0.1):
            if self._stop.is_set():
                return False
        for batch in step:
            batch["stem"] = self.tier.fetch(batch["tokens"], ids, training=self.training)
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

    # ---- the training thread's side of the worker ----
    def next_ids(self) -> torch.Tensor:
        """The ids the next step reads, once the worker has read its micro-batches; empty when the data has ended."""
        if self._ended:
            return torch.empty(0, dtype=torch.int64)
        with self._turns:
            if self._plans and self._taken >= self._permitted:  # the worker waits for a turn that cannot come
                raise RuntimeError("RowPipeline.next_ids: the step before was not begun (its first micro-batch not "
                                   "taken), so the prefetch thread may not plan this one")
            self._taken += 1
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
            self.store.counters[key] += value
        return item

    def take_wait_s(self) -> float:
        wait, self.wait_s = self.wait_s, 0.0
        return wait

    def _close(self, wait: bool = True) -> None:
        """Stop the worker; ``wait``: first let it plan the step it may (its peers on every rank plan it too: a
        training loop that ended normally). Not after an error, where a peer may never plan it."""
        if self._plans and wait:
            with self._turns:
                while self._planned < self._permitted and not self._over:
                    self._turns.wait(0.1)
        self._stop.set()
        self._thread.join(timeout=5)
        if self._plans:
            self.tier.end_planning_ahead()
