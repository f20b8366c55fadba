"""The rows a step reads, resident on the compute device with their masters and Adam moments.

Design: docs/gpu_step_v2.md. Without it, the host updates the rows the next step reads between the clip and the
next forward (CPU Adam, the refresh, micro-batch 0's fetch: 0.25-0.45 s a step at 1B on one H100 by the note's
estimate). With a working set (``host_tables.resident_rows``) every STEM layer keeps slots of fixed device tensors
``[C, cols]``: the master row, ``exp_avg`` and ``exp_avg_sq``, in the host record's dtypes and shapes
(``table_state.StateSpec``: fp32, or lean). Then:

- the forward gathers a micro-batch's rows by slot on the device, from the masters cast to the dtype rows travel
  in (the values a fetch of the host copies gives): no host gather, no copy to the device, and no copy of the
  masters in that dtype to keep (a seventh of the slots' bytes);
- the step's row gradients stay on the device, and right after the clip one AdamW updates the step's slots (lazy)
  or every resident slot (dense; the rows not resident decay on the host, with zero gradients, as in the host tier);
- the next step's ids are then admitted: rows not resident enter with their state from the host; rows leave (the
  least counted of those the next step does not read) when slots run short, and their state goes back to the host
  on a side stream, landed by the Adam thread beside the next step. The entering rows are loaded ahead, while the
  step before runs (``preload``, called by the prefetch thread as it announces a step; with dense Adam only until
  that step's update begins, each row once its host decay of the last step is done: ``adam_thread.LaterDecay``). Those
  that find no free slot then are gathered then (``staged_rows.StagedRows``), copied at ``admit`` and put in place
  by each layer's first reader (dense Adam: with the step's decay, which they missed).

On GPU the slots' tensors are the compute stream's alone, whichever thread issues the work: the side streams copy
entering rows into tensors of their own, which the compute stream puts in place after their event, and copy leaving
rows out of tensors the compute stream gathered. Rows are disjoint where the two overlap in time (the step's against
the next step's), but torch's CUDA sanitizer keys an access by the tensor, not by the rows: a side stream writing free
slots while the compute stream reads others is a race to it (tests/test_working_set_streams.py checks this).

The host tables stay the record of every row not resident; ``write_back`` makes them whole for a reader of the
tables (``store.settle``: checkpoints, export, validation). The update is the host tier's AdamW (``row_optimizer``:
DeepSpeed's kernel on CPU, bitwise the host tier's values; torch's fused AdamW on GPU, within fp32 rounding).

At DP > 1 a rank's set holds the rows it owns (``ownership``) that the group's next step reads, and updates them with
every rank's gradients; the other ranks receive the updated rows (``step_rows.StepRows``).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist

from stem_megatron.host_tables.adam_thread import MissedUpdate
from stem_megatron.host_tables.counters import Counted
from stem_megatron.host_tables.row_optimizer import RowOptimizer
from stem_megatron.host_tables.row_state import KINDS, HostRecord, RowState
from stem_megatron.host_tables.staged_rows import StagedRows
from stem_megatron.host_tables.transfer import (DeviceToHost, Fetched, HostToDevice, PrefetchedRows, copy_to_device,
                                                landed, positions_in_step, staged_rows, working_set_bytes)
from stem_megatron.model.stem_rows import RowOrder

GROWTH = 1.25  # a set too small for a step's distinct ids grows by at least this factor


class WorkingSet(Counted):
    """Per STEM layer, ``capacity`` device slots of rows with their optimizer state; ``slot_of`` maps ids to
    slots (-1: not resident) on the host."""

    def __init__(self, layers: list[int], capacity: int, vocab_size: int, cols: int, device: torch.device,
                 travel: torch.dtype, host: HostRecord, optimizer: RowOptimizer, ahead: bool = False,
                 moving_rows: int = 0, tokens: int = 0):
        """``travel``: the dtype the forward reads rows in (``transfer.travel_dtype``); ``host``: the record rows enter
        from and leave to (its ``state``, ``local`` and ``write``); ``optimizer``: the slots' (``rows`` kernel on CPU,
        ``fused`` on GPU). ``ahead``: entering rows load during the step before theirs (``preload``). With dense Adam
        (``optimizer.dense``) every row changes every step: ``update`` covers every resident slot, and rows load ahead
        only until the step before begins its update (``begin_update``).
        ``moving_rows``: the most rows that enter or leave at once (at most a step's, or the capacity), whose pinned
        staging and landing are reserved here (GPU; ``tokens``: a micro-batch's, whose indices a fetch stages), and
        the rows staged ahead's (``transfer.staged_rows``; 0: by the capacity)."""
        self.layers, self.cols, self.device, self.travel = layers, cols, device, travel
        self.host = host
        self.optimizer = optimizer
        if optimizer.spec.lean:  # the lean update rounds by each slot's token id (weakly: no cycle through the set)
            ws = weakref.ref(self)
            optimizer.token_ids = lambda slots: ws().ids[slots.cpu()]
        self.slot_of = torch.full((vocab_size,), -1, dtype=torch.int64)
        self.counts = torch.zeros(vocab_size, dtype=torch.int64)  # steps that read each row: who stays when short
        self.ids = torch.empty(0, dtype=torch.int64)  # the id in each slot (-1: free)
        self.state = RowState(*({layer: torch.zeros(0, *rows[layer].shape[1:], dtype=rows[layer].dtype, device=device)
                                 for layer in layers} for rows in map(host.state.kind, KINDS)))  # the host's kinds
        slot, landing = working_set_bytes(moving_rows, cols, tokens) if moving_rows else (0, 0)
        self.h2d = HostToDevice(device, slot_bytes=slot)  # entering state, in its dtypes as it is on the host
        self.d2h = DeviceToHost(device)  # leaving state
        for layer in layers:
            for kind in KINDS:
                self.d2h.reserve((layer, kind), landing)
        self.ahead, self.dense = ahead, optimizer.dense
        rows = staged_rows(moving_rows or capacity, len(layers)) if ahead else 0
        self.staged = StagedRows(layers, cols, rows, self.h2d.copies)
        self._arriving: dict[int, tuple] = {}  # (GPU) layer -> its staged rows copied, to put in place (``_arrived``)
        self.compute = torch.cuda.current_stream(device) if device.type == "cuda" else None  # the training thread's
        self.running = torch.empty(0, dtype=torch.int64)  # the ids of the step now running (the last admitted)
        self._lock = threading.Lock()  # the slot map: ``admit`` (training thread) and ``preload`` (prefetch thread)
        self._landed = threading.Event()  # the rows that left at the last ``admit`` are on the host again
        self._landed.set()
        self._preloadable = False  # (dense) from an ``admit`` to the next ``begin_update``: ``preload`` may load
        self.stats = self.new_stats()
        self._grow(min(capacity, vocab_size))

    @staticmethod
    def new_stats() -> dict:
        """Rows (a layer each) that entered (of them: ahead; at the step's end from ``StagedRows``) and left;
        seconds the training thread spent in the slots' AdamW (on GPU issuing it; on CPU running it: work the device
        does on a GPU); seconds the prefetch thread spent planning and loading rows ahead (``DeviceTier``)."""
        return dict(rows_entered=0, rows_entered_ahead=0, rows_entered_staged=0, rows_left=0, resident_update_s=0.0,
                    ahead_s=0.0)

    @property
    def capacity(self) -> int:
        return self.ids.numel()

    def _grow(self, capacity: int, step_ids: int = 0) -> None:
        """Slots to ``capacity``, keeping the resident rows where they are; ``step_ids``: the distinct ids of the step
        that needs them (said in one line), 0 when the set is made."""
        if step_ids and dist.is_initialized() and dist.get_rank() == 0:
            print(f"host_tables.resident_rows: a step needs {step_ids} rows here; the working set grows from "
                  f"{self.capacity} to {capacity} rows a layer (set host_tables.resident_rows to at least that)",
                  flush=True)
        more = capacity - self.capacity
        self.ids = torch.cat([self.ids, torch.full((more,), -1, dtype=torch.int64)])
        for kind in KINDS:
            state = self.state.kind(kind)
            for layer in self.layers:
                state[layer] = torch.cat([state[layer], state[layer].new_zeros(more, state[layer].shape[1])])

    # ---- the forward's side ----
    def fetch(self, tokens: torch.Tensor, step_ids: torch.Tensor, by_position: bool = False) -> PrefetchedRows:
        """(prefetch thread) A training micro-batch's ids, inverse index, row order and slots on the device; the
        rows themselves are gathered by the forward (``read``), on its stream, after the last update.
        ``by_position``: the "slots" are the ids' positions among the step's (DP > 1: rows received from their
        owners, ``step_rows.StepRows``)."""
        uniq, inverse = torch.unique(tokens.cpu(), return_inverse=True)
        positions = positions_in_step(step_ids, uniq)
        slots = positions if by_position else self.slot_of[uniq]
        if uniq.numel() and int(slots.min()) < 0:
            raise RuntimeError("a micro-batch reads rows its step did not admit to the working set: fetch with the "
                               "step's announced ids after its admission (HostTableStore.stream does both)")
        with self.h2d.transfer() as send:
            order = RowOrder(*(send.copy(t) for t in RowOrder.of(inverse.t(), uniq.numel())))
            at, inverse = send.copy(slots), send.copy(inverse)
            in_step = at if by_position else send.copy(positions)
        stats = dict(unique_tokens=uniq.numel(), rows_fetched=0, bytes_to_device=0, cache_hits=0, cache_lookups=0)
        return PrefetchedRows(uniq, inverse, Fetched({}, send.ready, stats), in_step, order, slots=at)

    def rows(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """``layer``'s rows at ``slots`` in the travel dtype: the masters rounded as the host copies a fetch reads."""
        self._arrived(layer)
        rows = self.state.master[layer].index_select(0, slots)
        return rows if rows.dtype == self.travel else rows.to(self.travel)

    def read(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """A micro-batch's rows of ``layer`` as an fp32 tensor (the layer's row leaf, whose gradient sums in fp32)."""
        return self.rows(layer, slots).float()

    # ---- after the clip ----
    def begin_update(self) -> None:
        """(dense, before the first ``update`` of a step) Rows loaded ahead so far are updated with the set (a zero
        gradient, as the host would decay them: ``preload`` issued their puts before it let go of the lock);
        ``preload`` loads no more until the next ``admit``, since a row entering later would miss both this update
        and the host's decay of the rows outside."""
        with self._lock:
            self._preloadable = False

    def update(self, step: int, lr: float, layer: int, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """AdamW on ``layer``'s slots of ``ids`` (sorted) with ``grads`` (``[len(ids), cols]``, on the device);
        dense Adam: every other resident slot too, with a zero gradient."""
        self._arrived(layer)
        slots, others = self.slot_of[ids], torch.empty(0, dtype=torch.int64)
        if self.dense:
            resident = self.ids >= 0
            resident[slots] = False
            others = resident.nonzero().squeeze(1)
        order = torch.argsort(slots)  # the gradients stay in the ids' order: ``order`` finds them
        self.optimizer.update(step, lr, self.state, layer, slots[order], grads, order, others)

    def outside(self, ids: torch.Tensor) -> torch.Tensor:
        """Those of ``ids`` not resident."""
        return ids[self.slot_of[ids] < 0]

    # ---- between steps ----
    def admit(self, ids: torch.Tensor, missed: Optional[MissedUpdate] = None) -> Optional[Callable[[], None]]:
        """Make the sorted ``ids`` (the next step's) resident. Returns the landing of the rows that left, to run
        on the Adam thread before anything reads the host record again (None: none left). Rows leave in the
        order of fewest steps that read them, then id: the same rows on every run. Rows ``preload`` brought
        ahead are in their slots already. ``missed`` (dense Adam, after a step's update): the entering rows take that
        update first, on the host before they load, or, staged, in their slots (the same kernel on CPU: bitwise)."""
        with self._lock:
            self._arrived()
            self.counts[ids] += 1
            entering = self.outside(ids)
            free = (self.ids < 0).nonzero().squeeze(1)
            short = entering.numel() - free.numel()
            land = None
            if short > 0:
                spare = self._spare(ids)
                if spare.numel() < short:  # the next step's rows do not fit: more slots (at least the step's ids)
                    self._grow(max(int(self.capacity * GROWTH), ids.numel()), ids.numel())
                    short = entering.numel() - int((self.ids < 0).sum())
                if short > 0:
                    land = self._evict(self._leaving(spare, short))
                free = (self.ids < 0).nonzero().squeeze(1)
            slots, staged = free[:entering.numel()], self.staged.take(entering)
            mask, rows = staged or (torch.zeros(entering.numel(), dtype=torch.bool), None)
            if missed is not None and not mask.all():
                missed.on_host(entering[~mask])
            self._load(entering[~mask], slots[~mask])
            if rows is not None:
                self._enter_staged(entering[mask], slots[mask], rows, missed)
            self.running = ids
            self._preloadable = True
            return land

    def preload(self, ids: torch.Tensor) -> None:
        """(prefetch thread, as it announces a step) With ``ahead``: the state of the announced step's rows that
        are not resident, loaded into free slots while the step before runs (copied on the side stream, put in place
        on the compute stream among that step's work). Exact with lazy Adam: that step updates its own rows only,
        and neither they nor their slots are touched here. With dense
        Adam (the host record of ``ids`` current: their decay of the last step done, ``LaterDecay``) only before
        that step's ``begin_update``: its update then covers them, a zero gradient as on the host. Room is made from
        rows neither step reads, landed here once the loads are issued, since their gather waits for the compute
        stream's work so far (lazy: their state is final; dense: the host decays them as rows outside). The state of
        those that still find no slot is staged (``StagedRows``, as many as it holds) for ``admit`` to put in place
        (dense: and to decay there, as the host would have before they entered); the rest are left to it."""
        if not self.ahead:
            return
        self._landed.wait()  # rows that left at the last admit: on the host before any of them is read again
        with self._lock:
            if self.dense and not self._preloadable:  # the step before has begun its update: admit loads them
                return
            entering = self.outside(ids)
            if not entering.numel():
                return
            free = (self.ids < 0).nonzero().squeeze(1)
            land, short = None, entering.numel() - free.numel()
            if short > 0:
                keep = torch.cat([self.running, ids])
                spare = self._spare(keep)
                leaving = min(short, spare.numel())
                if leaving:
                    land = self._evict(self._leaving(spare, leaving))
                free = (self.ids < 0).nonzero().squeeze(1)
            try:  # the freed slots' puts come after their gather on the compute stream
                late, entering = entering[free.numel():], entering[:free.numel()]
                self._load(entering, free[:entering.numel()], ahead=True)
                self.stats["rows_entered_ahead"] += entering.numel() * len(self.layers)
                self.staged.stage(late, self.host)
            finally:
                if land is not None:
                    land()

    def _spare(self, keep: torch.Tensor) -> torch.Tensor:
        """Slots of resident rows not among ``keep``."""
        resident = self.ids >= 0
        kept = keep[self.slot_of[keep] >= 0]
        resident[self.slot_of[kept]] = False
        return resident.nonzero().squeeze(1)

    def _leaving(self, spare: torch.Tensor, n: int) -> torch.Tensor:
        """The ``n`` of the ``spare`` slots whose rows fewest steps read (then by id: no ties), sorted."""
        key = self.counts[self.ids[spare]] * self.slot_of.numel() + self.ids[spare]
        return torch.sort(spare[torch.topk(key, n, largest=False).indices]).values

    def _on_compute(self) -> contextlib.AbstractContextManager:
        """Work issued inside runs on the compute stream, from whichever thread (GPU; nothing on CPU)."""
        return contextlib.nullcontext() if self.compute is None else torch.cuda.stream(self.compute)

    def _load(self, ids: torch.Tensor, slots: torch.Tensor, ahead: bool = False) -> None:
        """The host state of rows ``ids`` into ``slots``: on GPU through pinned staging on the side stream, into
        tensors of its own, then put in place on the compute stream, a layer while the next layer's copy runs.
        ``ahead`` (the prefetch thread, while a step runs): this thread waits for each copy before its put, so the
        compute stream never does."""
        if not ids.numel():
            return
        local, last = self.host.local(ids), None
        for layer in [*self.layers, None]:  # each layer's put once the next layer's copy is issued
            if last is not None:
                if ahead and last[-1] is not None:
                    last[-1].synchronize()
                self._in_place(*last)
            if layer is not None:
                with self.h2d.transfer() as send:
                    rows = {kind: send.gather(self.host.state.kind(kind)[layer], local) for kind in KINDS}
                    at = send.copy(slots)
                last = (layer, at, rows, send.ready)
        self.slot_of[ids] = slots
        self.ids[slots] = ids
        self.stats["rows_entered"] += ids.numel() * len(self.layers)

    def _enter_staged(self, ids: torch.Tensor, slots: torch.Tensor, rows: RowState,
                      missed: Optional[MissedUpdate]) -> None:
        """Staged rows ``ids`` (``StagedRows.take``'s ``rows``) into ``slots``, then (``missed``) decayed there. On GPU
        copied on the side stream, each layer's end recorded, and put in place (and decayed) on the compute stream by
        that layer's first reader (``_arrived``): the compute stream goes on meanwhile."""
        if not ids.numel():
            return
        self.slot_of[ids] = slots  # first: a lean decay in the slots rounds by their ids
        self.ids[slots] = ids
        copies = self.h2d.copies
        if copies is None:
            for layer in self.layers:
                self._in_place(layer, slots, rows.layer(layer), missed=missed)
        else:
            with self.h2d.transfer() as send:  # on the side stream; the slots through its staging
                at = send.copy(slots)
                for layer in self.layers:
                    copied = {kind: copies.to_device(value) for kind, value in rows.layer(layer).items()}
                    self._arriving[layer] = (at, copied, copies.record(), missed)
            self.staged.copied = send.ready
        self.stats["rows_entered"] += ids.numel() * len(self.layers)
        self.stats["rows_entered_staged"] += ids.numel() * len(self.layers)

    def _arrived(self, layer: Optional[int] = None) -> None:
        """The staged rows ``_enter_staged`` copied, put in place: ``layer``'s, or every layer's (GPU; nothing pending
        on CPU)."""
        for key in [layer] if layer is not None else list(self._arriving):
            arrival = self._arriving.pop(key, None)
            if arrival is not None:
                at, rows, ready, missed = arrival
                self._in_place(key, at, rows, ready, missed)

    def _in_place(self, layer: int, at: torch.Tensor, rows: dict[str, torch.Tensor], ready=None,
                  missed: Optional[MissedUpdate] = None) -> None:
        """``rows`` into ``layer``'s slots ``at`` on the compute stream, then (``missed``) decayed there; ``ready``:
        the end of their copies on a side stream (GPU), which the compute stream waits for."""
        with self._on_compute():
            if ready is not None:  # copied on the side stream, used and let go on this one
                stream = torch.cuda.current_stream()
                stream.wait_event(ready)
                for value in (at, *rows.values()):
                    value.record_stream(stream)
            for kind, value in rows.items():
                self.state.kind(kind)[layer].index_copy_(0, at, value)
            if missed is not None:
                self.optimizer.decay(missed.step, missed.lr, self.state, layer, at)

    def _evict(self, slots: torch.Tensor) -> Callable[[], None]:
        """Free ``slots`` (sorted): their state is gathered on the compute stream after the slots' last update (from
        whichever thread) and goes to the host on the side stream. Returns its landing, which the caller runs; until it
        has, ``preload`` waits."""
        ids = self.ids[slots]
        with self._on_compute():
            at = copy_to_device(slots, self.device)
            copies = {(layer, kind): self.d2h.copy(self.state.kind(kind)[layer].index_select(0, at), (layer, kind))
                      for layer in self.layers for kind in KINDS}
        self.slot_of[ids] = -1
        self.ids[slots] = -1
        self.stats["rows_left"] += ids.numel() * len(self.layers)
        self._landed.clear()

        def land() -> None:
            try:
                for (layer, kind), (rows, event) in copies.items():
                    landed(event)
                    self.host.write(layer, kind, ids, rows)
            finally:
                self._landed.set()
        return land

    def write_back(self) -> None:
        """Every resident row's state into the host record (the rows stay resident); waits for it."""
        with self._lock:
            self._arrived()
            slots = (self.ids >= 0).nonzero().squeeze(1)
            at, ids = slots.to(self.device), self.ids[slots]
            for layer in self.layers if slots.numel() else ():
                for kind in KINDS:
                    self.host.write(layer, kind, ids, self.state.kind(kind)[layer].index_select(0, at).cpu())

    def drop(self) -> None:
        """Forget every resident row (the host record was loaded anew: a checkpoint, ``load_tables``)."""
        with self._lock:
            self.slot_of.fill_(-1)
            self.ids.fill_(-1)
            self.staged.drop()
            self._arriving.clear()
            self.running = torch.empty(0, dtype=torch.int64)
            self._preloadable = False
