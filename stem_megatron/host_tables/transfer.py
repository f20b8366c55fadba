"""Moving STEM rows from host memory to the compute device, selected by device.

On GPU the rows are gathered straight into pinned staging (``pinned.StagingPool``: a slot per fetch, reserved
before the first step, so no pageable copy, no pinned allocation during training, and no fetch shares bytes with
another, on whichever thread) and copied on a side stream, so the copy overlaps the compute of the current
micro-batch; the consumer's stream waits on an event before using them. Rows
travel in the model's compute precision (bf16 on GPU): the layer casts its fp32 row leaf to that dtype
before any use, so rounding on the host first changes no value and halves the bytes. On CPU the gathered
rows are already where compute happens: no copy, no event. Rows held by the hot-row cache come from its
device copies instead of host memory. Training (``store``) and inference (``read_only``) fetch through
``fetch_rows``.

The other way, a step's row gradients land in pinned host buffers (``pinned.DeviceToHost``), copied on a
side stream during the backward, layer by layer. With host tables the training thread waits for a layer's copy
(``pinned.landed``) where the clip scales or CPU Adam reads its gradients (``store.scale_gradients``,
``store.step``), after the step's gradient norm has already waited for the backward.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Optional

import torch

from stem_megatron.data.integrity import check_token_ids
from stem_megatron.host_tables.pinned import CudaCopies, StagingPool
from stem_megatron.model.stem_rows import RowOrder

SCRATCH_BYTES = 4 << 20  # a fetching thread's reused buffer for rows narrowed on the way (fits in L2/L3)


@dataclass
class Fetched:
    """A micro-batch's rows per STEM layer, the event marking their arrival, and fetch counters."""

    rows: dict[int, torch.Tensor]
    ready: Optional[torch.cuda.Event]
    stats: dict


@dataclass
class PrefetchedRows:
    """What a host-resident STEM layer needs for one micro-batch."""

    uniq: torch.Tensor  # sorted unique token ids
    inverse: torch.Tensor  # [b, s]: position of each token's id in ``uniq``, on the device
    fetched: Fetched
    in_step: Optional[torch.Tensor] = None  # training: positions of ``uniq`` among the step's ids, on the device
    order: Optional[RowOrder] = None  # the tokens ([s, b] order) sorted by row, for the layer's backward (device)
    slots: Optional[torch.Tensor] = None  # training with a working set: each of ``uniq``'s slot there (device)

    def wait(self) -> None:
        """Make the current stream wait for the rows and the inverse index (GPU); a no-op on CPU."""
        if self.fetched.ready is None:
            return
        stream = torch.cuda.current_stream()
        stream.wait_event(self.fetched.ready)
        extra = [t for t in (self.in_step, self.slots, *(self.order or ())) if t is not None]
        for t in (*self.fetched.rows.values(), self.inverse, *extra):
            t.record_stream(stream)  # allocated on the side stream, used on this one


class HostToDevice:
    """The copy engine's side of fetches: a side stream and pinned staging (``pinned.StagingPool``) on GPU,
    nothing on CPU. Each fetch's copies go through ``transfer()``, which gives the fetch a staging slot of its
    own, so fetches on several threads never share bytes.

    The hot-row cache is reloaded through transfers too (``cache.HotRowCache.reload``), so its rows are written
    and read on the side stream alone, in issue order: a fetch never reads cached rows from before the step.
    """

    def __init__(self, device: torch.device, dtype: Optional[torch.dtype] = None, slot_bytes: int = 0, copies=None):
        """``dtype``: the precision rows travel in where it is narrower than the table's (the model's compute
        dtype; None: the table's). ``slot_bytes``: a fetch's staging, planned (``pinned.staging_bytes``; 0: sized
        by the first fetches). ``copies``: the copy engine (default: ``pinned.CudaCopies`` on GPU, none on CPU)."""
        self.device, self.dtype = device, dtype
        self.copies = copies if copies is not None else CudaCopies(device) if device.type == "cuda" else None
        self.staging = StagingPool(self.copies, slot_bytes) if self.copies is not None else None
        self._scratch = threading.local()  # per fetching thread: see ``Transfer.gather``

    def scratch(self, row_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """This thread's reused buffer of whole rows (at least one) of ``row_shape`` in ``dtype``."""
        row_bytes = max(1, math.prod(row_shape) * dtype.itemsize)
        buffer = getattr(self._scratch, "buffer", None)
        if buffer is None or buffer.numel() < row_bytes:
            buffer = self._scratch.buffer = torch.empty(max(SCRATCH_BYTES, row_bytes), dtype=torch.uint8)
        rows = buffer.numel() // row_bytes
        return buffer[:rows * row_bytes].view(dtype).view(rows, *row_shape)

    @contextlib.contextmanager
    def transfer(self) -> Iterator["Transfer"]:
        """One fetch's copies (issued on the side stream, through a staging slot of its own on GPU); the
        transfer's ``ready`` marks their end once the block is left."""
        if self.copies is None:
            yield Transfer(self, None)
            return
        with self.staging.slot() as slot, self.copies.stream():
            transfer = Transfer(self, slot)
            try:
                yield transfer
            finally:
                transfer.ready = slot.done = self.copies.record()


class Transfer:
    """The copies of one fetch (``HostToDevice.transfer``)."""

    def __init__(self, h2d: HostToDevice, slot):
        self.h2d, self.slot = h2d, slot
        self.ready = None  # the event ending the copies (GPU), set when the transfer ends

    def gather(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``table[ids]`` on the device: on GPU gathered into the staging slot and copied from there."""
        dtype = travel_dtype(table.dtype, self.h2d.dtype)
        if self.slot is None:
            return table.index_select(0, ids).to(dtype)
        staged = self.slot.carve((ids.numel(), *table.shape[1:]), dtype, self.h2d.copies)
        if dtype == table.dtype:
            torch.index_select(table, 0, ids, out=staged)
        else:  # narrowed through this thread's scratch, a few MB at a time: no [rows, cols] temporary to fault in
            scratch = self.h2d.scratch(tuple(table.shape[1:]), table.dtype)
            for start in range(0, ids.numel(), scratch.shape[0]):
                part = ids[start:start + scratch.shape[0]]
                gathered = torch.index_select(table, 0, part, out=scratch[:part.numel()])
                staged[start:start + part.numel()].copy_(gathered)
        return self.h2d.copies.to_device(staged)

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device, through the staging slot on GPU."""
        if self.slot is None:
            return tensor
        staged = self.slot.carve(tuple(tensor.shape), tensor.dtype, self.h2d.copies)
        staged.copy_(tensor)
        return self.h2d.copies.to_device(staged)


def travel_dtype(table: torch.dtype, compute: Optional[torch.dtype]) -> torch.dtype:
    """The dtype rows cross to the device in: the compute dtype where it is narrower than the table's."""
    return compute if compute is not None and compute.itemsize < table.itemsize else table


def fetch_rows(tokens: torch.Tensor, vocab_size: int, tables: Mapping[int, torch.Tensor], cache,
               h2d: HostToDevice, at: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
               step_ids: Optional[torch.Tensor] = None) -> tuple[PrefetchedRows, torch.Tensor]:
    """The rows a forward over ``tokens`` ([b, s]) needs: ``table[unique ids]`` of every ``{layer: [V,
    cols] host table}`` on the device, in fp32 (a bf16 table is cast on the device, after the copy).
    ``at`` maps ids to table rows (the training store's ownership order; default: row = id); ``step_ids``
    (training: the sorted ids of the step this micro-batch belongs to) adds ``in_step``. Ids the
    ``HotRowCache`` holds come from its device rows, the others are gathered from host memory (only the
    distinct ids). The ids are range-checked here, before any lookup, and not again in the forward
    (``token_context``).

    Returns the rows (``fetched.stats`` empty, for the caller's counters) and the hit mask over the ids.
    """
    check_token_ids(tokens, vocab_size)
    uniq, inverse, counts = torch.unique(tokens.cpu(), return_inverse=True, return_counts=True)
    cache.observe(uniq, counts)
    hit, pos = cache.split(uniq)
    miss = uniq[~hit]
    any_hit = bool(hit.any())
    rows = {}
    with h2d.transfer() as send:  # every copy below is issued on the side stream (GPU), staged in its own slot
        if any_hit:  # positions of hits and misses among the ids, computed here: no mask indexing on the device
            hit_at, miss_at, pos = (send.copy(t) for t in (hit.nonzero().squeeze(1), (~hit).nonzero().squeeze(1), pos))
        rows_at = miss if at is None else at(miss)
        for layer, table in tables.items():
            fetched = send.gather(table, rows_at)
            if any_hit:
                out = torch.empty(uniq.numel(), table.shape[1], dtype=fetched.dtype, device=h2d.device)
                out.index_copy_(0, hit_at, cache.rows[layer].index_select(0, pos).to(fetched.dtype))
                out.index_copy_(0, miss_at, fetched)
                fetched = out
            rows[layer] = fetched.float()  # the layer's row leaf: gradients sum in fp32
        order = RowOrder(*(send.copy(t) for t in RowOrder.of(inverse.t(), uniq.numel())))  # sorted here, once
        inverse = send.copy(inverse)
        in_step = None if step_ids is None else send.copy(positions_in_step(step_ids, uniq))
    ready = send.ready
    return PrefetchedRows(uniq, inverse, Fetched(rows, ready, {}), in_step, order), hit


def positions_in_step(step_ids: torch.Tensor, uniq: torch.Tensor) -> torch.Tensor:
    """Where each of ``uniq`` sits in the sorted ``step_ids``, which must hold them all."""
    at = torch.searchsorted(step_ids, uniq)
    if uniq.numel() and (int(at.max()) >= step_ids.numel() or not torch.equal(step_ids[at], uniq)):
        raise RuntimeError("a micro-batch holds token ids its step did not announce (RowPrefetcher)")
    return at
