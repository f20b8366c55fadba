"""The device tier: the rows a step reads stay on the device with their state, in a working set (docs/host_tables.md).

Design: docs/gpu_step_v2.md. The step, between the clip and the next step's first fetch:

1. AdamW on the working set's slots, the step's gradients where they are (the device); on CPU on the Adam thread,
   whose cores DeepSpeed's kernel uses.
2. Dense Adam only: the rows not resident decay with zero gradients on the host, first those the next step reads that
   did not load ahead, since they enter the set below with their state: on the host before they load, or in their
   slots where the prefetch thread staged them (``MissedUpdate``).
3. The next step's ids admitted: entering rows' state from the host, leaving rows' back to it. At DP > 1 the next step
   is planned first (``plan``): a rank admits the rows it owns of those any rank reads, and every rank then receives
   its next step's rows from their owners (``OwnerTier``), at this one place on every rank; rows other nodes
   own are stale in this node's host copy from here until a refresh pulls them. The prefetch thread has planned that
   step already, before it announced it (``plan_ahead``, over groups of its own), and its owned rows not resident
   were loaded beside the step before, also before the announcement (``preload``), so before this step's 1. began.
4. Beside the next step (``host_tables.overlap_update``), on the Adam thread: the leaving rows landed in the host
   record, and dense Adam's other rows decayed, first those the prefetch thread loads ahead for the step after
   (``adam_thread.LaterDecay``). The next step's update (and ``settle``, ``refresh``) waits for them first.

Where a step reads its rows depends on the DP group's size, chosen once by the store: ``DeviceTier`` at DP = 1,
``OwnerTier`` at DP > 1.
"""

from __future__ import annotations

import queue
import time
from typing import Callable, Optional

import torch

from stem_megatron.host_tables.adam_thread import LaterDecay, MissedUpdate
from stem_megatron.host_tables.counters import Counted
from stem_megatron.host_tables.exchange import Route, RowExchange
from stem_megatron.host_tables.host_tier import Grads, fetch_from_copy, make_current, row_bytes
from stem_megatron.host_tables.hot_rows import HotRowCache
from stem_megatron.host_tables.row_optimizer import RowOptimizer
from stem_megatron.host_tables.row_state import HostRecord
from stem_megatron.host_tables.transfer import HostToDevice, PrefetchedRows, copy_to_device
from stem_megatron.host_tables.working_set import WorkingSet

EMPTY = torch.empty(0, dtype=torch.int64)


class DeviceTier:
    """Rows read from and updated in a working set of ``capacity`` slots a layer (``host_tables.resident_rows``); at
    DP = 1, where every row is this rank's: read by slot from its set, a step planned (no routes) as it is admitted.
    ``OwnerTier``: DP > 1."""

    by_position = False  # a micro-batch's rows: slots of the working set

    def __init__(self, record: HostRecord, exchange: RowExchange, optimizer: RowOptimizer, updates, counters: dict,
                 h2d: HostToDevice, cache: HotRowCache, capacity: int, travel: torch.dtype, moving_rows: int,
                 tokens: int):
        """``updates``: the Adam thread (``adam_thread.RowUpdates``); ``counters``: the store's step counters; ``h2d``,
        ``cache`` (holding no rows: ``config.validate``): validation's fetches; ``travel``: the dtype rows are read in;
        ``moving_rows``: the most rows entering or leaving at once, and ``tokens`` a micro-batch's, whose pinned memory
        is reserved here."""
        self.record, self.exchange, self.optimizer, self.updates = record, exchange, optimizer, updates
        self.counters, self.h2d, self.layers = counters, h2d, record.layers
        self.cache, self._row_bytes = cache, row_bytes(record, h2d)
        self.device = optimizer.device
        # the slots' back end (their token ids: ``WorkingSet``); ``optimizer``: the host record's
        slots = RowOptimizer(optimizer.adam, "fused" if self.device.type == "cuda" else "rows", self.device,
                             optimizer.dense, optimizer.spec, optimizer.seed, optimizer.col0)
        self.ws = WorkingSet(self.layers, capacity, record.vocab_size, record.cols, self.device, travel, record,
                             slots, ahead=True, moving_rows=moving_rows, tokens=tokens)
        self.later_decay = LaterDecay(record.vocab_size, record.cols * len(self.layers)) if optimizer.dense else None
        mine = record.own.my_rows()  # the rows this rank updates: a mask over ids, and their count
        self.mine = torch.zeros(record.vocab_size, dtype=torch.bool)
        self.mine[mine] = True
        self._mine_rows = mine.numel()
        self._planned = None  # (ids, their plan): a step planned before it begins (``plan``)

    @property
    def parts(self) -> list:
        """The parts with counters of their own."""
        return [self.ws, *([self.later_decay] if self.later_decay is not None else [])]

    # ---- the prefetch thread ----
    def preload(self, ids: torch.Tensor) -> None:
        """(prefetch thread, ``pipeline.PreloadPipeline``) A training step reads the sorted ``ids``: their rows not
        resident load while the step before runs (``WorkingSet.preload``), with dense Adam once their decay of the step
        before that is done."""
        start = time.perf_counter()
        if self.later_decay is not None:
            self.later_decay.wait_for(ids)
        self.ws.preload(ids)
        self.ws.stats["ahead_s"] += time.perf_counter() - start

    def fetch(self, tokens: torch.Tensor, step_ids: torch.Tensor, training: bool = True) -> PrefetchedRows:
        """A training micro-batch's slots in the working set (``by_position``: its ids' positions among the step's
        rows received from the owners): the forward gathers the rows (``read``). Validation's rows come from the node's
        copy (the caller has written the set back: ``HostTableStore.refresh``)."""
        if not training:
            return fetch_from_copy(self.record, tokens, step_ids, self.cache, self.h2d, self._row_bytes)
        return self.ws.fetch(tokens, step_ids, by_position=self.by_position)

    # ---- the training thread ----
    def read(self, layer: int, prefetched: PrefetchedRows) -> torch.Tensor:
        """A micro-batch's rows of ``layer``, gathered on this stream after the last update (validation's: fetched)."""
        if prefetched.slots is None:
            return prefetched.fetched.rows[layer]
        return self._read(layer, prefetched.slots)

    def _read(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self.ws.read(layer, slots)

    def planned(self, ids: torch.Tensor) -> tuple[list, torch.Tensor]:
        """(a step of the sorted ``ids`` begins) Its plan, made when it was admitted (``plan``), else made now
        (``RowExchange.plan``: a collective over the exchange groups' gloo twins)."""
        planned, self._planned = self._planned, None
        return planned[1] if planned is not None and torch.equal(planned[0], ids) else self.exchange.plan(ids)

    def plan(self, ids: torch.Tensor) -> tuple[list[Route], torch.Tensor]:
        """The routes of a step reading the sorted ``ids`` to the rows' owners and the ids this rank updates in it,
        kept for its beginning (``planned``)."""
        plan = self._plan(ids)
        self._planned = (ids, plan)
        return plan

    def _plan(self, ids: torch.Tensor) -> tuple[list[Route], torch.Tensor]:
        return self.exchange.plan(ids)

    def land(self, layer: int, grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        """A layer's gradients at their owners stay where the working set updates them (the device)."""
        return grads, None

    def admit(self, ids: torch.Tensor) -> None:
        """Before a training step's first fetch: the node's copy of its rows current (``make_current``), then the
        step's ``ids`` (sorted) resident, at DP > 1 those this rank owns, and every rank's rows sent to it. Collective
        over the node and the DP group (``plan``, ``OwnerTier.receive``)."""
        make_current(self, ids)
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
                self.counters["rows_updated"] += self._mine_rows if dense else ids.numel()

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
            self.counters["rows_updated_later"] += rest.numel() * len(self.layers)
        land = self._enter(routes, owned, missed)

        def later() -> None:
            try:
                if land is not None:
                    land()
            finally:  # even after a failed landing: a preload waits for these rows
                if rest.numel():
                    self.later_decay.run(rest, decay)
        return later

    def settle(self) -> None:
        """The last step's Adam thread work done, then every resident row's state into the host record (the rows stay
        resident)."""
        self.updates.settle()
        self.ws.write_back()

    def drop(self, steps_done: Optional[int] = None) -> None:
        """The host record was loaded anew: the working set forgets its rows."""
        self.ws.drop()

    def _enter(self, routes: list, owned: torch.Tensor,
               missed: Optional[MissedUpdate] = None) -> Optional[Callable[[], None]]:
        """A planned step's rows this rank updates (``owned``) admitted to the working set. Returns the landing of the
        rows that left (``WorkingSet.admit``)."""
        return self.ws.admit(owned, missed)


class OwnerTier(DeviceTier, Counted):
    """The device tier at DP > 1: a rank's working set holds the rows it owns (``ownership.RowOwnership``), where they
    are updated once, with every rank's gradients (``RowExchange.to_owners``); per STEM layer every rank reads the rows
    of the step about to run as received from their owners, in the order of its sorted distinct ids.

    Right after the owners' update and the admission of the next step's rows, each owner sends its rows of the next
    step back along that step's routes reversed (``RowExchange.from_owners``), in the dtype rows travel in, every layer
    at once, on the training thread where every rank issues the step's other collectives. Readers hold no optimizer
    state: a row changes only at its owner. Bytes: a rank receives its step's distinct rows once (0.53 GB a step over 1B
    STEM-1/3's 5 layers at TP 1 in bf16). The prefetch thread plans each step as it announces it (``plan_ahead``:
    ``pipeline.PlannedPipeline``), so that the rows this rank owns of it can load during the step before."""

    by_position = True  # a micro-batch's rows: positions among the step's received rows (``WorkingSet.fetch``)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows: dict[int, torch.Tensor] = {}  # layer -> the step's rows from their owners (``_receive``)
        self.stats = self.new_stats()
        self._plans: Optional[queue.Queue] = None  # the prefetch thread's plans, in step order (``plan_ahead``)

    @property
    def parts(self) -> list:
        return [*super().parts, self]

    @staticmethod
    def new_stats() -> dict:
        """Rows received a step (each layer counted) and the training thread's seconds receiving them."""
        return dict(rows_received=0, receive_s=0.0)

    # ---- the prefetch thread ----
    def begin_planning_ahead(self) -> None:
        """(training thread, every rank of the DP group alike, a training stream opens) From now on each training step
        is planned by the prefetch thread as it announces it (``plan_ahead``)."""
        self._plans = queue.Queue()

    def end_planning_ahead(self) -> None:
        """(training thread, the stream closes) Steps are planned by the training thread again; plans not taken are
        dropped."""
        self._plans = None

    def plan_ahead(self, ids: torch.Tensor) -> None:
        """(prefetch thread, announcing a training step of the sorted ``ids``, after ``begin_planning_ahead``) The
        step's plan (``RowExchange.plan`` over the planning groups: only this thread issues on them, one step after the
        other on every rank), kept for ``plan``."""
        if not ids.numel():
            return
        start = time.perf_counter()
        self._plans.put((ids, self.exchange.plan(ids, ahead=True)))  # (ids, (routes, the ids this rank updates))
        self.ws.stats["ahead_s"] += time.perf_counter() - start

    def preload(self, ids: torch.Tensor) -> None:
        """Of a training step's sorted ``ids``, the rows this rank owns load ahead (their host state is its own)."""
        super().preload(ids[self.mine[ids]])

    # ---- the training thread ----
    def _read(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """A micro-batch's rows of ``layer`` by position among the step's ids, as an fp32 tensor (the layer's leaf):
        the rows received, not the working set's."""
        rows = self.rows.get(layer)
        if rows is None:
            raise RuntimeError("a training step reads rows its owners did not send: fetch a step's rows after its "
                               "admission (store.stream does both)")
        return rows.index_select(0, positions).float()

    def _plan(self, ids: torch.Tensor) -> tuple[list[Route], torch.Tensor]:
        """The prefetch thread's plan of the step (``plan_ahead``), else ``RowExchange.plan`` here, a collective over
        the exchange groups' gloo twins."""
        if self._plans is None or not ids.numel():
            return self.exchange.plan(ids)
        try:  # announced: the prefetch thread planned it first
            planned_ids, (routes, owned) = self._plans.get_nowait()
        except queue.Empty:
            planned_ids = None
        if planned_ids is None or not torch.equal(planned_ids, ids):
            raise RuntimeError("the prefetch thread planned another step than the one the training thread admits: "
                               "steps are admitted with the ids the pipeline announced, in order")
        return [route.on(self.device) for route in routes], owned

    def update(self, step: int, lr: float, grads: Grads, next_ids: torch.Tensor) -> Callable[[], None]:
        """As ``DeviceTier.update``; after it, rows other nodes own changed there, not in this node's copy."""
        later = super().update(step, lr, grads, next_ids)
        if self.record.node.rail is not None:
            self.record.current.fill_(False)
        return later

    def drop(self, steps_done: Optional[int] = None) -> None:
        """The working set and the received rows forgotten (the host record was loaded anew)."""
        super().drop(steps_done)
        self.rows = {}

    def _enter(self, routes: list[Route], owned: torch.Tensor,
               missed: Optional[MissedUpdate] = None) -> Optional[Callable[[], None]]:
        """The rows this rank owns of a planned step admitted, then every rank's rows of it received from their owners
        (``_receive``)."""
        land = super()._enter(routes, owned, missed)
        self._receive(routes, owned)
        return land

    def _receive(self, routes: list[Route], owned: torch.Tensor) -> None:
        """(training thread) The rows of the step ``routes`` plan, from their owners; ``owned``: this rank's rows of
        it, resident in its working set and updated. Collective over the exchange's groups (on every rank; a stage
        without STEM layers has none to send on any of its ranks)."""
        if not self.layers:
            return
        start, ws = time.perf_counter(), self.ws
        slots = copy_to_device(ws.slot_of[owned], ws.device)
        mine = [ws.rows(layer, slots) for layer in self.layers]
        every = self.exchange.from_owners(routes, mine[0] if len(mine) == 1 else torch.cat(mine, dim=1))
        self.rows = dict(zip(self.layers, every.split(ws.cols, dim=1)))
        self.stats["rows_received"] += every.shape[0] * len(self.layers)
        self.stats["receive_s"] += time.perf_counter() - start
