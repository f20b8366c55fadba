"""A working set's entering rows that find no free slot while the step before runs, their state gathered ahead
(the device tier's: ``working_set.WorkingSet``)."""

from __future__ import annotations

from typing import Optional

import torch

from stem_megatron.host_tables.row_state import KINDS, HostRecord, RowState
from stem_megatron.host_tables.transfer import staged_bytes


class StagedRows:
    """A working set's entering rows that cannot load ahead, their state gathered ahead: up to ``rows``
    rows a layer, every layer's state in one buffer, from ``stage`` (prefetch thread) to ``take`` (the next ``admit``,
    training thread); the set's lock serialises the two.

    A working set loads the next step's entering rows while the step before runs (``WorkingSet.preload``), into slots
    neither step reads. Where the two steps' rows outnumber the slots (a set sized to the memory goal: 8,947 rows a
    layer at 1B, where two steps read ~9.2k), the rest can take a slot only at ``admit``, on the step's path (339 rows a
    layer a step at 1B on CPU, 167 MB gathered in 8-33 ms and copied in ~7 ms while the device waits:
    docs/benchmarks.md). Their state can be read as early as the step is announced (lazy Adam: a row outside the set is
    final on the host until it enters; dense: once its decay of the step before that is done, and before the next
    update begins, ``admit`` then giving it the missed decay in its slot: ``adam_thread.MissedUpdate``). ``stage``
    gathers it then into a buffer kept for it (pinned on GPU, reserved when the store is built:
    ``transfer.staged_bytes``); at ``admit`` the set takes it (``take``) and, on GPU, copies it on the side stream,
    each layer's first reader putting its rows in place (``WorkingSet.rows``)."""

    def __init__(self, layers: list[int], cols: int, rows: int, copies=None):
        """``copies``: the set's ``transfer.CudaCopies`` (GPU: the buffer is pinned now), None on CPU."""
        self.layers, self.cols, self.rows = layers, cols, rows
        nbytes = staged_bytes(rows, len(layers), cols)
        self._buffer = copies.pinned(nbytes) if copies is not None else torch.empty(nbytes, dtype=torch.uint8)
        self.ids: Optional[torch.Tensor] = None  # the staged ids (sorted); None: nothing staged
        self._state: Optional[RowState] = None  # views of the buffer: each kind and layer ``[len(ids), its cols]``
        self.copied: Optional[torch.cuda.Event] = None  # (GPU) the last copies out of the buffer end here

    def stage(self, ids: torch.Tensor, host: HostRecord) -> None:
        """The state of the first ``rows`` of the sorted ``ids`` (not resident) from the ``host`` record, in place of
        anything staged before."""
        self.ids = self._state = None
        ids = ids[:self.rows]
        if not ids.numel():
            return
        if self.copied is not None:  # the last take's copies read the buffer: they end before it is written again
            self.copied.synchronize()
            self.copied = None
        state, local, at = RowState({}, {}, {}), host.local(ids), 0
        for kind in KINDS:  # in the record's dtypes and shapes (``StateSpec``), each view 4-byte aligned
            for layer in self.layers:
                table = host.state.kind(kind)[layer]
                nbytes = ids.numel() * table.shape[1] * table.element_size()
                view = self._buffer[at:at + nbytes].view(table.dtype).view(ids.numel(), table.shape[1])
                state.kind(kind)[layer] = torch.index_select(table, 0, local, out=view)
                at += -(-nbytes // 4) * 4
        self.ids, self._state = ids, state

    def take(self, entering: torch.Tensor) -> Optional[tuple[torch.Tensor, RowState]]:
        """The staged rows of the sorted ``entering`` ids: (a mask over ``entering``, their state in the mask's order),
        or None where nothing is staged or a staged id is not entering (the step differs from the one staged for: its
        rows load from the host). Whatever was staged is let go."""
        ids, state, self.ids, self._state = self.ids, self._state, None, None
        if ids is None:
            return None
        mask = torch.isin(entering, ids)
        if not torch.equal(entering[mask], ids):
            return None
        return mask, state

    def drop(self) -> None:
        """Forget the staged rows (the host record was loaded anew)."""
        self.ids = self._state = None
