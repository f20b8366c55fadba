"""The device tier: the rows a step reads stay on the device with their state, in a working set (docs/host_tables.md).

Design: docs/gpu_step_v2.md. The step, between the clip and the next step's first fetch:

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
   (``adam_thread.LaterDecay``). The next step's update (and ``settle``, ``refresh``) waits for them first.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from stem_megatron.host_tables.adam_thread import LaterDecay, MissedUpdate
from stem_megatron.host_tables.exchange import RowExchange
from stem_megatron.host_tables.host_tier import Grads, fetch_from_copy, row_bytes
from stem_megatron.host_tables.hot_rows import HotRowCache
from stem_megatron.host_tables.row_optimizer import RowOptimizer
from stem_megatron.host_tables.row_state import HostRecord
from stem_megatron.host_tables.step_rows import OwnRows, StepRows
from stem_megatron.host_tables.transfer import HostToDevice, PrefetchedRows
from stem_megatron.host_tables.working_set import WorkingSet

EMPTY = torch.empty(0, dtype=torch.int64)


class DeviceTier:
    """Rows read from and updated in a working set of ``capacity`` slots a layer (``host_tables.resident_rows``)."""

    def __init__(self, record: HostRecord, exchange: RowExchange, optimizer: RowOptimizer, updates, counters: dict,
                 h2d: HostToDevice, cache: HotRowCache, capacity: int, travel: torch.dtype, moving_rows: int,
                 tokens: int, dp: int):
        """``updates``: the Adam thread (``adam_thread.RowUpdates``); ``counters``: the store's step counters; ``h2d``,
        ``cache`` (holding no rows: ``config.validate``): validation's fetches; ``travel``: the dtype rows are read in;
        ``moving_rows``: the most rows entering or leaving at once, and ``tokens`` a micro-batch's, whose pinned memory
        is reserved here; ``dp``: the DP group's size."""
        self.record, self.exchange, self.optimizer, self.updates = record, exchange, optimizer, updates
        self.counters, self.h2d, self.layers = counters, h2d, record.layers
        self.cache, self._row_bytes = cache, row_bytes(record, h2d)
        self.device = optimizer.device
        slots = RowOptimizer(optimizer.adam, "fused" if self.device.type == "cuda" else "rows", self.device,
                             optimizer.dense)  # the slots' back end; ``optimizer``: the host record's
        self.ws = WorkingSet(self.layers, capacity, record.vocab_size, record.cols, self.device, travel, record,
                             slots, ahead=True, moving_rows=moving_rows, tokens=tokens)
        self.later_decay = LaterDecay(record.vocab_size, record.cols * len(self.layers)) if optimizer.dense else None
        mine = record.own.my_rows()  # the rows this rank updates: a mask over ids, and their count
        self.mine = torch.zeros(record.vocab_size, dtype=torch.bool)
        self.mine[mine] = True
        self._mine_rows = mine.numel()
        # where a step's rows are read, by the DP group's size: chosen once
        self.step_rows = StepRows(exchange, self.ws, self.mine) if dp > 1 else OwnRows(exchange)
        self._planned = None  # (ids, their plan): a step planned before it begins (``plan``)

    @property
    def parts(self) -> list:
        """The parts with counters of their own."""
        return [self.ws, *self.step_rows.parts, *([self.later_decay] if self.later_decay is not None else [])]

    # ---- the prefetch thread ----
    def begin_planning_ahead(self) -> bool:
        """(training thread, every rank of the DP group alike) Whether the prefetch thread plans each training step
        as it announces it (``plan_ahead``; at DP > 1: ``step_rows.StepRows``)."""
        return self.step_rows.begin_planning_ahead()

    def end_planning_ahead(self) -> None:
        self.step_rows.end_planning_ahead()

    def plan_ahead(self, ids: torch.Tensor) -> torch.Tensor:
        """(prefetch thread, announcing a training step of the sorted ``ids``) Its plan, kept for the training
        thread's ``plan``; returns the ids this rank updates in it, which ``preload`` loads."""
        return self.step_rows.plan_ahead(ids)

    def preload(self, ids: torch.Tensor) -> None:
        """(prefetch thread) A training step reads the sorted ``ids`` (at DP > 1: those this rank updates): their rows
        not resident load while the step before runs (``WorkingSet.preload``), with dense Adam once their decay of the
        step before that is done. At DP > 1 only rows this rank owns load here (their host state is its own)."""
        start = time.perf_counter()
        ids = self.step_rows.owned(ids)
        if self.later_decay is not None:
            self.later_decay.wait_for(ids)
        self.ws.preload(ids)
        self.ws.stats["ahead_s"] += time.perf_counter() - start

    def fetch(self, tokens: torch.Tensor, step_ids: torch.Tensor, training: bool = True) -> PrefetchedRows:
        """A training micro-batch's slots in the working set (at DP > 1 its ids' positions among the step's rows
        received from the owners): the forward gathers the rows (``read``). Validation's rows come from the node's
        copy (the caller has written the set back: ``HostTableStore.refresh``)."""
        if not training:
            return fetch_from_copy(self.record, tokens, step_ids, self.cache, self.h2d, self._row_bytes)
        return self.ws.fetch(tokens, step_ids, by_position=self.step_rows.by_position)

    # ---- the training thread ----
    def read(self, layer: int, prefetched: PrefetchedRows) -> torch.Tensor:
        """A micro-batch's rows of ``layer``, gathered on this stream after the last update (validation's: fetched)."""
        if prefetched.slots is None:
            return prefetched.fetched.rows[layer]
        return self.step_rows.read(layer, prefetched.slots, self.ws)

    def planned(self, ids: torch.Tensor) -> tuple[list, torch.Tensor]:
        """(a step of the sorted ``ids`` begins) Its plan, made when it was admitted (``plan``), else made now
        (``RowExchange.plan``: a collective over the exchange groups' gloo twins)."""
        planned, self._planned = self._planned, None
        return planned[1] if planned is not None and torch.equal(planned[0], ids) else self.exchange.plan(ids)

    def plan(self, ids: torch.Tensor) -> tuple[list, torch.Tensor]:
        """The routes of a step reading the sorted ``ids`` to the rows' owners and the ids this rank updates in it
        (``step_rows``), kept for its beginning (``planned``)."""
        plan = self.step_rows.plan(ids)
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
        self.step_rows.updated(self.record)

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
        self.step_rows.drop()

    def _enter(self, routes: list, owned: torch.Tensor,
               missed: Optional[MissedUpdate] = None) -> Optional[Callable[[], None]]:
        """A planned step's rows this rank updates (``owned``) admitted to the working set, then (DP > 1) every rank's
        rows of it received from their owners (``step_rows``). Returns the landing of the rows that left (``WorkingSet.admit``)."""
        land = self.ws.admit(owned, missed)
        self.step_rows.receive(routes, owned)
        return land
