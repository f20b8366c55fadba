"""Where a working set's step reads its rows, chosen once by the DP group's size (the device tier's:
``device_tier.DeviceTier``): ``OwnRows`` at DP = 1, every row this rank's own and read by slot from its working set;
``StepRows`` at DP > 1, a rank's set holding the rows it owns, every rank receiving its step's rows from their owners
and the prefetch thread planning each step ahead."""

from __future__ import annotations

import queue
import time
from typing import Optional

import torch

from stem_megatron.host_tables.counters import Counted
from stem_megatron.host_tables.exchange import Route, RowExchange
from stem_megatron.host_tables.row_state import HostRecord
from stem_megatron.host_tables.transfer import copy_to_device
from stem_megatron.host_tables.working_set import WorkingSet


class OwnRows:
    """At DP = 1 every row is this rank's, resident in its working set and read there by slot; a step's plan (no
    routes: nothing to send) is made as it is admitted."""

    by_position = False  # a micro-batch's rows: slots of the working set
    parts: tuple = ()

    def __init__(self, exchange: RowExchange):
        self.exchange = exchange

    def begin_planning_ahead(self) -> bool:
        """False: the training thread plans each step as it is admitted."""
        return False

    def end_planning_ahead(self) -> None:
        """Nothing was planned ahead."""

    def plan_ahead(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids``: every one is this rank's to load."""
        return ids

    def plan(self, ids: torch.Tensor) -> tuple[list[Route], torch.Tensor]:
        return self.exchange.plan(ids)

    def owned(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def updated(self, record: HostRecord) -> None:
        """The host copy is this node's alone: nothing changed elsewhere."""

    def receive(self, routes: list[Route], owned: torch.Tensor) -> None:
        """The rows are in this rank's set already."""

    def read(self, layer: int, slots: torch.Tensor, resident: WorkingSet) -> torch.Tensor:
        """A micro-batch's rows of ``layer`` from the tier's working set, by slot."""
        return resident.read(layer, slots)

    def drop(self) -> None:
        """Nothing held beside the working set."""


class StepRows(Counted):
    """At DP > 1, per STEM layer the rows of the step about to run, received from their owners, in the order of its
    sorted distinct ids.

    A row is updated once, by its owner (``ownership.RowOwnership``), in the owner's working set, with every rank's
    gradients (``RowExchange.to_owners``). Right after the owners' update and the admission of the next step's rows,
    each owner sends its rows of the next step back along that step's routes reversed (``RowExchange.from_owners``),
    in the dtype rows travel in, every layer at once, on the training thread where every rank issues the step's other
    collectives. Readers hold no optimizer state: a row changes only at its owner. Bytes: a rank receives its step's
    distinct rows once (0.53 GB a step over 1B STEM-1/3's 5 layers at TP 1 in bf16)."""

    by_position = True  # a micro-batch's rows: positions among the step's received rows (``WorkingSet.fetch``)

    def __init__(self, exchange: RowExchange, resident: WorkingSet, mine: torch.Tensor):
        """``mine``: a mask over ids, True where this rank updates the row (``ownership.RowOwnership``)."""
        self.layers, self.exchange, self.resident, self.mine = resident.layers, exchange, resident, mine
        self.rows: dict[int, torch.Tensor] = {}
        self.stats = self.new_stats()
        self._plans: Optional[queue.Queue] = None  # the prefetch thread's plans, in step order (``plan_ahead``)

    @property
    def parts(self) -> list:
        return [self]

    @staticmethod
    def new_stats() -> dict:
        """Rows received a step (each layer counted) and the training thread's seconds in ``receive``."""
        return dict(rows_received=0, receive_s=0.0)

    def begin_planning_ahead(self) -> bool:
        """(training thread, every rank of the DP group alike) From now on each training step is planned by the
        prefetch thread as it announces it (``plan_ahead``), so that the rows this rank owns of it can load during the
        step before."""
        self._plans = queue.Queue()
        return True

    def end_planning_ahead(self) -> None:
        """(training thread) Steps are planned by the training thread again; plans not taken are dropped."""
        self._plans = None

    def plan_ahead(self, ids: torch.Tensor) -> torch.Tensor:
        """(prefetch thread, announcing a training step of the sorted ``ids``, after ``begin_planning_ahead``) The
        step's plan (``RowExchange.plan`` over the planning groups: only this thread issues on them, one step after the
        other on every rank), kept for ``plan``. Returns the ids this rank updates in it; without planning ahead,
        ``ids``."""
        if self._plans is None or not ids.numel():
            return ids
        start = time.perf_counter()
        planned = self.exchange.plan(ids, ahead=True)  # (routes, the ids this rank updates)
        self._plans.put((ids, planned))
        self.resident.stats["ahead_s"] += time.perf_counter() - start
        return planned[1]

    def plan(self, ids: torch.Tensor) -> tuple[list[Route], torch.Tensor]:
        """The routes of a step reading the sorted ``ids`` to the rows' owners and the ids this rank updates in it: the
        prefetch thread's plan of it (``plan_ahead``), else ``RowExchange.plan`` here, a collective over the exchange
        groups' gloo twins."""
        if self._plans is None or not ids.numel():
            return self.exchange.plan(ids)
        try:  # announced: the prefetch thread planned it first
            planned_ids, (routes, owned) = self._plans.get_nowait()
        except queue.Empty:
            planned_ids = None
        if planned_ids is None or not torch.equal(planned_ids, ids):
            raise RuntimeError("the prefetch thread planned another step than the one the training thread admits: "
                               "steps are admitted with the ids the pipeline announced, in order")
        return [route.on(self.resident.device) for route in routes], owned

    def owned(self, ids: torch.Tensor) -> torch.Tensor:
        """Those of ``ids`` whose rows load into this rank's set: the ones it owns (their host state is its own)."""
        return ids[self.mine[ids]]

    def updated(self, record: HostRecord) -> None:
        """After the owners' update: rows other nodes own changed there, not in this node's copy."""
        if record.node.rail is not None:
            record.current.fill_(False)

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

    def read(self, layer: int, positions: torch.Tensor, resident: WorkingSet) -> torch.Tensor:
        """A micro-batch's rows of ``layer`` by position among the step's ids, as an fp32 tensor (the layer's leaf):
        the rows received, not the ``resident`` set's."""
        rows = self.rows.get(layer)
        if rows is None:
            raise RuntimeError("a training step reads rows its owners did not send: fetch a step's rows after its "
                               "admission (store.stream does both)")
        return rows.index_select(0, positions).float()

    def drop(self) -> None:
        """Forget the received rows (the host record was loaded anew)."""
        self.rows = {}
