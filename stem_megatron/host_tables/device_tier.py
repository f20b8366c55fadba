"""The device tier: the rows a step reads stay on the device with their state, in a working set (docs/host_tables.md).

Design: docs/gpu_step_v2.md (issue 31). The step, between the clip and the next step's first fetch:

1. AdamW on the working set's slots, the step's gradients where they are (the device); on CPU on the Adam thread,
   whose cores DeepSpeed's kernel uses.
2. Dense Adam only: the rows not resident decay with zero gradients on the host, first those the next step reads that
   did not load ahead, since they enter the set below with their state: on the host before they load, or in their
   slots where the prefetch thread staged them (``MissedUpdate``).
3. The next step's ids admitted: entering rows' state from the host, leaving rows' back to it. At DP > 1 the next step
   is planned first (``plan``): a rank admits the rows it owns of those any rank reads, and every rank then receives
   its next step's rows from their owners (``StepRows.receive``), at this one place on every rank; rows other nodes
   own are stale in this node's host copy from here until a refresh pulls them. The prefetch thread has planned that
   step already, as it announced it (``plan_ahead``, over groups of its own), and its owned rows not resident were
   loaded beside the step before (``preload``; with dense Adam only those loaded before this step's 1. began).
4. Beside the next step (``host_tables.overlap_update``), on the Adam thread: the leaving rows landed in the host
   record, and dense Adam's other rows decayed, first those the prefetch thread loads ahead for the step after
   (``row_optimizer.LaterDecay``). The next step's update (and ``settle``, ``refresh``) waits for them first.
"""

from __future__ import annotations

import queue
import time
from typing import Callable, Optional

import torch

from stem_megatron.host_tables.exchange import Route, RowExchange
from stem_megatron.host_tables.host_tier import Grads, HotRowCache, fetch_from_copy, row_bytes
from stem_megatron.host_tables.row_optimizer import LaterDecay, MissedUpdate, RowOptimizer
from stem_megatron.host_tables.row_state import HostRecord
from stem_megatron.host_tables.transfer import HostToDevice, PrefetchedRows, copy_to_device
from stem_megatron.host_tables.working_set import WorkingSet

EMPTY = torch.empty(0, dtype=torch.int64)


class StepRows:
    """At DP > 1, per STEM layer the rows of the step about to run, received from their owners, in the order of its
    sorted distinct ids.

    A row is updated once, by its owner (``ownership.RowOwnership``), in the owner's working set, with every rank's
    gradients (``RowExchange.to_owners``). Right after the owners' update and the admission of the next step's rows,
    each owner sends its rows of the next step back along that step's routes reversed (``RowExchange.from_owners``),
    in the dtype rows travel in, every layer at once, on the training thread where every rank issues the step's other
    collectives. Readers hold no optimizer state: a row changes only at its owner. Bytes: a rank receives its step's
    distinct rows once (0.53 GB a step over 1B STEM-1/3's 5 layers at TP 1 in bf16)."""

    def __init__(self, layers: list[int], exchange: RowExchange, resident: WorkingSet):
        self.layers, self.exchange, self.resident = layers, exchange, resident
        self.rows: dict[int, torch.Tensor] = {}
        self.stats = self.new_stats()

    @staticmethod
    def new_stats() -> dict:
        """Rows received a step (each layer counted) and the training thread's seconds in ``receive``."""
        return dict(rows_received=0, receive_s=0.0)

    def receive(self, routes: list[Route], owned: torch.Tensor) -> None:
        """(training thread) The rows of the step ``routes`` plan, from their owners; ``owned``: this rank's rows of
        it, resident in its working set and updated. Collective over the exchange's groups (on every rank; a stage
        without STEM layers has none to send on any of its ranks)."""
        if not self.layers:
            return
        start = time.perf_counter()
        slots = copy_to_device(self.resident.slot_of[owned], self.resident.device)
        mine = [self.resident.rows(layer, slots) for layer in self.layers]
        every = self.exchange.from_owners(routes, mine[0] if len(mine) == 1 else torch.cat(mine, dim=1))
        self.rows = dict(zip(self.layers, every.split(self.resident.cols, dim=1)))
        self.stats["rows_received"] += every.shape[0] * len(self.layers)
        self.stats["receive_s"] += time.perf_counter() - start

    def read(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """A micro-batch's rows of ``layer`` by position among the step's ids, as an fp32 tensor (the layer's leaf)."""
        rows = self.rows.get(layer)
        if rows is None:
            raise RuntimeError("a training step reads rows its owners did not send: fetch a step's rows after its "
                               "admission (store.stream does both)")
        return rows.index_select(0, positions).float()

    def drop(self) -> None:
        """Forget the received rows (the host record was loaded anew)."""
        self.rows = {}


class DeviceTier:
    """Rows read from and updated in a working set of ``capacity`` slots a layer (``host_tables.resident_rows``)."""

    def __init__(self, record: HostRecord, exchange: RowExchange, optimizer: RowOptimizer, updates, counters: dict,
                 h2d: HostToDevice, capacity: int, travel: torch.dtype, moving_rows: int, tokens: int, dp: int):
        """``updates``: the Adam thread (``pipeline.RowUpdates``); ``counters``: the store's step counters; ``h2d``:
        validation's fetches; ``travel``: the dtype rows are read in; ``moving_rows``: the most rows entering or leaving
        at once, and ``tokens`` a micro-batch's, whose pinned memory is reserved here; ``dp``: the DP group's size."""
        self.record, self.exchange, self.optimizer, self.updates = record, exchange, optimizer, updates
        self.stats, self.h2d, self.layers = counters, h2d, record.layers
        self._no_cache, self._row_bytes = HotRowCache(0, record.vocab_size, optimizer.device), row_bytes(record, h2d)
        self.device = optimizer.device
        slots = RowOptimizer(optimizer.adam, "fused" if self.device.type == "cuda" else "rows", self.device,
                             optimizer.dense)  # the slots' back end; ``optimizer``: the host record's
        self.ws = WorkingSet(self.layers, capacity, record.vocab_size, record.cols, self.device, travel, record,
                             slots, ahead=True, moving_rows=moving_rows, tokens=tokens)
        self.later_decay = LaterDecay(record.vocab_size, record.cols * len(self.layers)) if optimizer.dense else None
        self.step_rows = StepRows(self.layers, exchange, self.ws) if dp > 1 else None
        mine = record.own.my_rows()  # the rows this rank updates: a mask over ids, and their count
        self.mine = torch.zeros(record.vocab_size, dtype=torch.bool)
        self.mine[mine] = True
        self._mine_rows = mine.numel()
        self._planned = None  # (ids, their plan): a step planned before it begins (``plan``)
        self._plans: Optional[queue.Queue] = None  # the prefetch thread's plans, in step order (``plan_ahead``)

    @property
    def parts(self) -> list:
        """The parts with counters of their own."""
        return [p for p in (self.ws, self.step_rows, self.later_decay) if p is not None]

    # ---- the prefetch thread ----
    def begin_planning_ahead(self) -> bool:
        """(training thread, every rank of the DP group alike) From now on each training step is planned by the
        prefetch thread as it announces it (``plan_ahead``), so that the rows this rank owns of it can load during the
        step before. Only at DP > 1 (at DP = 1 every id is the rank's own: nothing to plan). Returns whether it does."""
        if self.step_rows is None:
            return False
        self._plans = queue.Queue()
        return True

    def end_planning_ahead(self) -> None:
        """(training thread) Steps are planned by the training thread again; plans not taken are dropped."""
        self._plans = None

    def plan_ahead(self, ids: torch.Tensor) -> torch.Tensor:
        """(prefetch thread, announcing a training step of the sorted ``ids``, after ``begin_planning_ahead``) The
        step's plan (``RowExchange.plan`` over the planning groups: only this thread issues on them, one step after the
        other on every rank), kept for the training thread's ``plan``. Returns the ids this rank updates in it, which
        ``preload`` loads; without planning ahead, ``ids``."""
        if self._plans is None or not ids.numel():
            return ids
        start = time.perf_counter()
        planned = self.exchange.plan(ids, ahead=True)  # (routes, the ids this rank updates)
        self._plans.put((ids, planned))
        self.ws.stats["ahead_s"] += time.perf_counter() - start
        return planned[1]

    def preload(self, ids: torch.Tensor) -> None:
        """(prefetch thread) A training step reads the sorted ``ids`` (at DP > 1: those this rank updates): their rows
        not resident load while the step before runs (``WorkingSet.preload``), with dense Adam once their decay of the
        step before that is done. At DP > 1 only rows this rank owns load here (their host state is its own)."""
        start = time.perf_counter()
        ids = ids if self.step_rows is None else ids[self.mine[ids]]
        if self.later_decay is not None:
            self.later_decay.wait_for(ids)
        self.ws.preload(ids)
        self.ws.stats["ahead_s"] += time.perf_counter() - start

    def fetch(self, tokens: torch.Tensor, step_ids: torch.Tensor, training: bool = True) -> PrefetchedRows:
        """A training micro-batch's slots in the working set (at DP > 1 its ids' positions among the step's rows
        received from the owners): the forward gathers the rows (``read``). Validation's rows come from the node's
        copy (the caller has written the set back: ``HostTableStore.refresh``)."""
        if not training:
            return fetch_from_copy(self.record, tokens, step_ids, self._no_cache, self.h2d, self._row_bytes)
        return self.ws.fetch(tokens, step_ids, by_position=self.step_rows is not None)

    # ---- the training thread ----
    def read(self, layer: int, prefetched: PrefetchedRows) -> torch.Tensor:
        """A micro-batch's rows of ``layer``, gathered on this stream after the last update (validation's: fetched)."""
        if prefetched.slots is None:
            return prefetched.fetched.rows[layer]
        return (self.step_rows or self.ws).read(layer, prefetched.slots)

    def planned(self, ids: torch.Tensor) -> Optional[tuple[list, torch.Tensor]]:
        """(a step of the sorted ``ids`` begins) Its plan, made when it was admitted (``plan``); None: none made."""
        planned, self._planned = self._planned, None
        return planned[1] if planned is not None and torch.equal(planned[0], ids) else None

    def plan(self, ids: torch.Tensor) -> tuple[list, torch.Tensor]:
        """The routes of a step reading the sorted ``ids`` to the rows' owners and the ids this rank updates in it, kept
        for its beginning (``planned``): the prefetch thread's plan of it (``plan_ahead``), else ``RowExchange.plan``
        here, a collective over the exchange groups' gloo twins."""
        if self._plans is not None and ids.numel():  # announced: the prefetch thread planned it first
            try:
                planned_ids, (routes, owned) = self._plans.get_nowait()
            except queue.Empty:
                planned_ids = None
            if planned_ids is None or not torch.equal(planned_ids, ids):
                raise RuntimeError("the prefetch thread planned another step than the one the training thread admits: "
                                   "steps are admitted with the ids the pipeline announced, in order")
            plan = ([route.on(self.device) for route in routes], owned)
        else:
            plan = self.exchange.plan(ids)
        self._planned = (ids, plan)
        return plan

    def admit(self, ids: torch.Tensor) -> None:
        """Before a training step's first fetch: the step's ``ids`` (sorted) resident, at DP > 1 those this rank owns,
        and every rank's rows sent to it. Collective over the DP group (``plan``, ``StepRows.receive``)."""
        self.updates.settle()
        land = self._enter(*self.plan(ids))
        if land is not None:
            land()

    def update(self, step: int, lr: float, grads: Grads, next_ids: torch.Tensor) -> Callable[[], None]:
        """AdamW on the slots, then the next step's rows admitted (and received); returns the landing of the rows that
        left and dense Adam's decay of the rest, for the Adam thread beside the next step."""
        ws, dense = self.ws, self.optimizer.dense

        def update() -> None:
            for layer in self.layers:
                ids, layer_grads, _ = grads.pop(layer, (EMPTY, torch.empty(0, ws.cols, device=self.device), None))
                ws.update(step, lr, layer, ids, layer_grads)
                self.stats["rows_updated"] += self._mine_rows if dense else ids.numel()

        def decay(ids: torch.Tensor) -> None:
            rows = torch.sort(self.record.local(ids)).values
            for layer in self.layers:
                self.optimizer.decay(step, lr, self.record.state, layer, rows)
                self.record.round_copies(layer, rows)

        start = time.perf_counter()
        if dense:
            ws.begin_update()
        if ws.optimizer.kernel == "rows":  # CPU: DeepSpeed's kernel on the Adam thread's cores
            self.updates.now(update)
        else:
            update()
        ws.stats["resident_update_s"] += time.perf_counter() - start
        routes, owned = self.plan(next_ids)  # at DP = 1: no routes, every id owned
        rest, missed = EMPTY, None
        if dense and self.layers:  # the rows this rank updates not resident: those entering now decay in admit
            read = torch.zeros(self.record.vocab_size, dtype=torch.bool)
            read[owned] = True
            rest = ((ws.slot_of < 0) & self.mine & ~read).nonzero().squeeze(1)
            missed = MissedUpdate(step, lr, lambda entering: self.updates.now(lambda: decay(entering)))
            self.later_decay.expect(rest)
            self.stats["rows_updated_later"] += rest.numel() * len(self.layers)
        land = self._enter(routes, owned, missed)
        if self.step_rows is not None and self.record.node.rail is not None:
            self.record.current.fill_(False)  # rows other nodes own changed there, not in this node's copy

        def later() -> None:
            try:
                if land is not None:
                    land()
            finally:  # even after a failed landing: a preload waits for these rows
                if rest.numel():
                    self.later_decay.run(rest, decay)
        return later

    def write_back(self) -> None:
        """Every resident row's state into the host record (the rows stay resident)."""
        self.ws.write_back()

    def drop(self, steps_done: Optional[int] = None) -> None:
        """The host record was loaded anew: the working set forgets its rows."""
        self.ws.drop()
        if self.step_rows is not None:
            self.step_rows.drop()

    def _enter(self, routes: list, owned: torch.Tensor,
               missed: Optional[MissedUpdate] = None) -> Optional[Callable[[], None]]:
        """A planned step's rows this rank updates (``owned``) admitted to the working set, then (DP > 1) every rank's
        rows of it received from their owners. Returns the landing of the rows that left (``WorkingSet.admit``)."""
        land = self.ws.admit(owned, missed)
        if self.step_rows is not None:
            self.step_rows.receive(routes, owned)
        return land
