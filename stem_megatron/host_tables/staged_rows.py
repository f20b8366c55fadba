"""A working set's entering rows that cannot load ahead, gathered ahead and put in place at the step's end (issue 31).

A working set loads the next step's entering rows while the step before runs (``WorkingSet.preload``), into slots
that neither step reads. Where the two steps' rows together outnumber the slots (a set sized to the memory goal: 8,947
rows a layer at 1B, where two steps read ~9.2k), the rest can take a slot only once the step before has updated its
rows and some of them have left: at ``admit``, on the step's path. Measured on CPU (docs/benchmarks.md) that is 339
rows a layer a step at 1B, 167 MB gathered on the host (8-33 ms) and copied (~7 ms) while the device waits.

With lazy Adam a row not resident is final on the host until it enters (only the step's rows update, and only
resident rows leave). With the recipe's dense Adam it changes once more, by the zero-gradient decay of the step
before it enters, which ``admit`` then gives it in its slot instead of on the host (``working_set.MissedUpdate``).
Either way its state can be read as early as the step is announced (dense: once its decay of the step before that is
done, and before the next update begins): ``stage`` gathers it then, on the prefetch thread, into a buffer kept for
it (pinned on GPU, reserved when the store is built: ``pinned.staged_bytes``). At ``admit`` the set takes the staged
rows (``take``) and, on GPU, copies them and puts them in their slots on the side stream, where each layer's first
reader waits for its own (``WorkingSet.rows``).
"""

from __future__ import annotations

from typing import Optional

import torch

from stem_megatron.host_tables.host_rows import KINDS
from stem_megatron.host_tables.pinned import staged_bytes


class StagedRows:
    """Up to ``rows`` entering rows a layer, every layer's state of them in one buffer, from ``stage`` (prefetch
    thread) to ``take`` (the next ``admit``, training thread); the caller serialises the two (the set's lock)."""

    def __init__(self, layers: list[int], cols: int, rows: int, copies=None):
        """``copies``: the set's ``pinned.CudaCopies`` (GPU: the buffer is pinned now), None on CPU."""
        self.layers, self.cols, self.rows = layers, cols, rows
        nbytes = staged_bytes(rows, len(layers), cols)
        self._buffer = copies.pinned(nbytes) if copies is not None else torch.empty(nbytes, dtype=torch.uint8)
        self.ids: Optional[torch.Tensor] = None  # the staged ids (sorted); None: nothing staged
        self._state: Optional[torch.Tensor] = None  # [layers, kinds, len(ids), cols] fp32 view of the buffer
        self.copied: Optional[torch.cuda.Event] = None  # (GPU) the last copies out of the buffer end here

    def stage(self, ids: torch.Tensor, host) -> None:
        """The state of the first ``rows`` of the sorted ``ids`` (not resident) from the ``host`` record
        (``working_set.HostRows``), in place of anything staged before."""
        self.ids = self._state = None
        ids = ids[:self.rows]
        if not ids.numel():
            return
        if self.copied is not None:  # the last take's copies read the buffer: they end before it is written again
            self.copied.synchronize()
            self.copied = None
        shape = (len(self.layers), len(KINDS), ids.numel(), self.cols)
        state = self._buffer[:4 * torch.Size(shape).numel()].view(torch.float32).view(shape)
        local = host.local(ids)
        for i, layer in enumerate(self.layers):
            for j, kind in enumerate(KINDS):
                torch.index_select(host.kind(kind)[layer], 0, local, out=state[i, j])
        self.ids, self._state = ids, state

    def take(self, entering: torch.Tensor) -> Optional[tuple[torch.Tensor, dict[int, dict[str, torch.Tensor]]]]:
        """The staged rows of the sorted ``entering`` ids: (a mask over ``entering``, ``{layer: {kind: rows}}`` in
        the mask's order), or None where nothing is staged or a staged id is not entering (the step differs from
        the one staged for: its rows load from the host). Whatever was staged is let go."""
        ids, state, self.ids, self._state = self.ids, self._state, None, None
        if ids is None:
            return None
        mask = torch.isin(entering, ids)
        if not torch.equal(entering[mask], ids):
            return None
        return mask, {layer: dict(zip(KINDS, state[i])) for i, layer in enumerate(self.layers)}

    def drop(self) -> None:
        """Forget the staged rows (the host record was loaded anew)."""
        self.ids = self._state = None
