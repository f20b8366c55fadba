"""The store's side of a working set (``working_set.WorkingSet``, issue 31): its making, the first step's admission,
the rows' reads, and ``store.step`` with it, which runs between the clip and the next step's first fetch:

1. AdamW on the working set's slots, the step's gradients where they are (the device); on CPU on the Adam thread,
   whose cores DeepSpeed's kernel uses.
2. Dense Adam only: the rows not resident decay with zero gradients (``store._update``), first those the next step
   reads that did not load ahead, since they enter the set below with their state: on the host before they load, or
   in their slots where the prefetch thread staged them (``WorkingSet.admit``'s ``missed``).
3. The next step's ids admitted: entering rows' state from the host, leaving rows' back to it. At DP > 1 the next
   step is planned first (``plan``): a rank admits the rows it owns of those any rank reads, and after the admission
   every rank receives its next step's rows from their owners (``step_rows.StepRows.receive``), at this one place on
   every rank; rows other nodes own are stale in this node's host copy from here until a ``refresh`` pulls them.
   The prefetch thread has planned that step already, as it announced it (``plan_ahead``, over groups of its own),
   and its owned rows not resident were loaded beside the step before (``preload``; with dense Adam only those loaded
   before this step's 1. began, which then covered them).
4. Beside the next step (``stem.overlap_update``), on the Adam thread: the leaving rows landed in the host record, and
   dense Adam's other rows decayed, first those the prefetch thread loads ahead for the step after
   (``later_decay.LaterDecay``). The next step's ``step`` (and ``settle``, ``refresh``) waits for them first.
"""

from __future__ import annotations

import queue
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from stem_megatron.host_tables.host_rows import HostRows
from stem_megatron.host_tables.later_decay import LaterDecay
from stem_megatron.host_tables.step_rows import StepRows
from stem_megatron.host_tables.working_set import MissedUpdate, WorkingSet


class ResidentRows:
    """The working-set side of ``store.HostTableStore`` (its base class)."""

    def _init_resident(self, resident_rows: int, optimizer: str, travel: torch.dtype, moving_rows: int,
                       tokens: int) -> None:
        """The working set of ``resident_rows`` slots a layer (0: none), rows held in the ``travel`` dtype; pinned
        memory reserved for ``moving_rows`` rows entering or leaving at once and fetches of ``tokens``."""
        self.resident = self.step_rows = self.later_decay = None
        self._planned = None  # (ids, their plan): a step planned before its ``begin_step`` (``plan``)
        self._plans: Optional[queue.Queue] = None  # the prefetch thread's plans, in step order (``plan_ahead``)
        if resident_rows:
            host = HostRows(self.master, self.exp_avg, self.exp_avg_sq, self.weight, self.own.local,
                            self.own.position)
            self.resident = WorkingSet(self.layers, resident_rows, self.vocab_size, self.cols, self.device, travel,
                                       host, self.adam, ahead=True, dense=optimizer == "dense",
                                       moving_rows=moving_rows, tokens=tokens)
            if optimizer == "dense":
                self.later_decay = LaterDecay(self.vocab_size, self.cols * len(self.layers))
            if dist.get_world_size(self.dp_group) > 1:
                self.step_rows = StepRows(self.layers, self.exchange, self.resident)
            mine = self.own.my_rows()  # the rows this rank updates: a mask over ids, and their count
            self.mine = torch.zeros(self.vocab_size, dtype=torch.bool)
            self.mine[mine] = True
            self._mine_rows = mine.numel()

    def drop_resident(self) -> None:
        """The host record was loaded anew: the working set (if any) forgets its rows."""
        if self.resident is not None:
            self.resident.drop()
        if self.step_rows is not None:
            self.step_rows.drop()

    def read_rows(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """(forward, with a working set) A micro-batch's rows of ``layer`` at the ``slots`` its fetch gave."""
        return (self.step_rows or self.resident).read(layer, slots)

    def plan(self, ids: torch.Tensor) -> tuple[list, torch.Tensor]:
        """The routes of a step reading the sorted ``ids`` to the rows' owners and the ids this rank updates in it,
        kept for its ``begin_step``: the prefetch thread's plan of it (``plan_ahead``), else ``RowExchange.plan``
        here, a collective over the exchange groups' gloo twins."""
        if self._plans is not None and ids.numel():  # announced: the prefetch thread planned it first
            try:
                planned_ids, (routes, owned) = self._plans.get_nowait()
            except queue.Empty:
                planned_ids = None
            if planned_ids is None or not torch.equal(planned_ids, ids):
                raise RuntimeError("the prefetch thread planned another step than the one the training thread "
                                   "admits: store.admit and store.step take the ids RowPrefetcher announced, in order")
            plan = ([route.on(self.device) for route in routes], owned)
        else:
            plan = self.exchange.plan(ids)
        self._planned = (ids, plan)
        return plan

    def begin_planning_ahead(self) -> bool:
        """(training thread, every rank of the DP group alike) From now on each training step is planned by the
        prefetch thread as it announces it (``plan_ahead``), so that the rows this rank owns of it can load during
        the step before. Only with a working set and DP > 1 (at DP = 1 every id is the rank's own: nothing to
        plan). Returns whether it does."""
        if self.step_rows is None:  # (with a working set the store made the planning groups)
            return False
        self._plans = queue.Queue()
        return True

    def end_planning_ahead(self) -> None:
        """(training thread) Steps are planned by the training thread again; plans not taken are dropped."""
        self._plans = None

    def plan_ahead(self, ids: torch.Tensor) -> torch.Tensor:
        """(prefetch thread, announcing a training step of the sorted ``ids``, after ``begin_planning_ahead``) The
        step's plan (``RowExchange.plan`` over the planning groups: only this thread issues on them, one step after
        the other on every rank), kept for the training thread's ``plan``. Returns the ids this rank updates in it,
        which ``preload`` loads; without planning ahead, ``ids``."""
        if self._plans is None or not ids.numel():
            return ids
        planned = self.exchange.plan(ids, ahead=True)  # (routes, the ids this rank updates)
        self._plans.put((ids, planned))
        return planned[1]

    def admit(self, ids: torch.Tensor) -> None:
        """Before a training step's first fetch: with a working set, the step's ``ids`` (sorted) resident, at DP > 1
        those this rank owns, and every rank's rows sent to it. Collective over the DP group (``plan``, ``receive``)."""
        if self.resident is not None:
            self.updates.settle()
            land = self._enter(*self.plan(ids))
            if land is not None:
                land()

    def _enter(self, routes: list, owned: torch.Tensor,
               missed: Optional[MissedUpdate] = None) -> Optional[Callable[[], None]]:
        """A planned step's rows this rank updates (``owned``) admitted to the working set, then (DP > 1) every rank's
        rows of it received from their owners. Returns the landing of the rows that left (``WorkingSet.admit``, as
        is ``missed``)."""
        land = self.resident.admit(owned, missed)
        if self.step_rows is not None:
            self.step_rows.receive(routes, owned)
        return land

    def preload(self, ids: torch.Tensor) -> None:
        """(prefetch thread) A training step reads the sorted ``ids`` (at DP > 1: ``plan_ahead``'s, those this rank
        updates): with a working set, their rows that are not resident load while the step before runs
        (``WorkingSet.preload``), with dense Adam once their decay of the step before that is done. At DP > 1 only
        rows this rank owns load here (their host state is its own)."""
        if self.resident is not None:
            ids = ids if self.step_rows is None else ids[self.mine[ids]]
            if self.later_decay is not None:
                self.later_decay.wait_for(ids)
            self.resident.preload(ids)

    def _step_resident(self, step: int, lr: float, next_ids: torch.Tensor) -> None:
        """``step`` with a working set: step ``step``; ``next_ids``: the next step's ids."""
        ws, none = self.resident, torch.empty(0, dtype=torch.int64)
        dense = ws.dense

        def update() -> None:
            for layer in self.layers:
                ids, grads, _ = self._grads.pop(layer, (none, torch.empty(0, self.cols, device=self.device), None))
                ws.update(step, lr, layer, ids, grads)
                self._stats["rows_updated"] += self._mine_rows if dense else ids.numel()

        def decay(ids: torch.Tensor) -> None:
            rows = torch.sort(self.own.local(ids)).values
            for layer in self.layers:
                self._update(step, lr, layer, rows, none, torch.empty(0, self.cols), None)

        start = time.perf_counter()
        if dense:
            ws.begin_update()
        if ws.kernel == "rows":  # CPU: DeepSpeed's kernel on the Adam thread's cores
            self.updates.now(update)
        else:
            update()
        ws.stats["resident_update_s"] += time.perf_counter() - start
        routes, owned = self.plan(next_ids)  # at DP = 1: no routes, every id owned
        rest, missed = none, None
        if dense and self.layers:  # the rows this rank updates not resident: those entering now decay in admit
            read = torch.zeros(self.vocab_size, dtype=torch.bool)
            read[owned] = True
            rest = ((ws.slot_of < 0) & self.mine & ~read).nonzero().squeeze(1)
            missed = MissedUpdate(step, lr, lambda entering: self.updates.now(lambda: decay(entering)))
            self.later_decay.expect(rest)
            self._stats["rows_updated_later"] += rest.numel() * len(self.layers)
        land = self._enter(routes, owned, missed)
        if self.step_rows is not None and self.node.rail is not None:
            self.current.fill_(False)  # rows other nodes own changed there, not in this node's copy
        self.steps_done = step

        def later() -> None:
            try:
                if land is not None:
                    land()
            finally:  # even after a failed landing: a preload waits for these rows
                if rest.numel():
                    self.later_decay.run(rest, decay)

        self.updates.later(later)
