"""STEM rows between host memory and the compute device: pinned buffers, side streams, fetches (the copy engine).

Fetches. On GPU the rows are gathered straight into pinned staging (``StagingPool``: a slot per fetch, reserved
before the first step, so no pageable copy, no pinned allocation during training, and no fetch shares bytes with
another, on whichever thread) and copied on a side stream, so the copy overlaps the compute of the current
micro-batch; the consumer's stream waits on an event before using them. Rows travel in the model's compute precision
(bf16 on GPU): the layer casts its fp32 row leaf to that dtype before any use, so rounding on the host first changes
no value and halves the bytes. On CPU the gathered rows are already where compute happens: no copy, no event. Rows
held by a hot-row cache come from its device copies instead of host memory. Training (the host tier) and inference
fetch through ``fetch_rows``.

The other way, a step's row gradients and a working set's leaving rows land in pinned host buffers (``DeviceToHost``)
on another side stream; whoever reads them first waits for their event (``landed``).

Pinned memory is allocated when the store is built, at the sizes the memory plan counts (``staging_bytes``,
``landing_rows``, ``working_set_bytes``, ``staged_bytes``; ``flops/memory.py`` uses the same functions), because
pinning (``cudaHostAlloc``) is slow and synchronises the device: done in the middle of a step it would stall it. A
request larger than planned (inference's batches, a store built without its batch sizes) grows its buffer once. A
step's indices made on the host (slots, routes: kilobytes) go through ``copy_to_device``, pinned in blocks that torch's
caching host allocator keeps and hands out again, so only a size's first request pins.
``CudaCopies`` is torch's side of it: a side stream, pinned allocations, events. Tests on a machine without a GPU pass
a stand-in with the same methods whose copies run late on a thread of their own, as a copy engine's do.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Optional

import torch

from stem_megatron.data.integrity import check_token_ids
from stem_megatron.host_tables.ownership import RowOwnership
from stem_megatron.model.stem_rows import RowOrder

STAGING_SLOTS = 2  # fetches whose staging is in use at once: one being gathered, one being copied
ALIGN = 64  # bytes: each buffer carved from a slot starts on a cache line


class CudaCopies:
    """Copies between pinned host memory and ``device`` on a side stream of their own."""

    def __init__(self, device: torch.device):
        self.device, self.side = device, torch.cuda.Stream(device)

    @staticmethod
    def pinned(nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def stream(self):
        """Work issued inside runs on the side stream."""
        return torch.cuda.stream(self.side)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True)

    def record(self) -> torch.cuda.Event:
        """An event at the side stream's current end; a thread waiting on it sleeps (``blocking``) rather than
        spin on a core the gathers and CPU Adam use."""
        event = torch.cuda.Event(blocking=True)
        event.record(self.side)
        return event


def copy_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor made during a step (slots, routes: indices) on ``device``, on the current stream, without a wait:
    on GPU from pinned memory, since from pageable memory the driver may synchronise with the stream to stage the
    copy (a stall of the issuing thread, hidden behind ``non_blocking``). The pinned copy is a block of torch's caching
    host allocator, pinned at the first request of its size and handed out again only after the copy's event. On CPU,
    already on the device, or the GPU branches run on a CPU (``cpu_compat``): the tensor as ``to`` gives it."""
    if device.type == "cuda" and tensor.device.type == "cpu" and torch.cuda.is_available():
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)



class _Slot:
    """One fetch's pinned staging: buffers carved one after another, and the event ending the fetch's copies."""

    def __init__(self, buffer: Optional[torch.Tensor]):
        self.buffer, self.used, self.done = buffer, 0, None

    def carve(self, shape: tuple[int, ...], dtype: torch.dtype, copies) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        start = -(-self.used // ALIGN) * ALIGN
        size = 0 if self.buffer is None else self.buffer.numel()
        if start + nbytes > size:  # larger than planned: a bigger buffer for the rest of this fetch and later ones
            # (the old one stays pinned until its copies end: torch's host allocator holds a block until then)
            self.buffer, start = copies.pinned(max(2 * size, nbytes, ALIGN)), 0
        self.used = start + nbytes
        return self.buffer[start:start + nbytes].view(dtype).view(shape)


class StagingPool:
    """Pinned host memory that fetched rows pass through, one slot per fetch. A fetch takes a slot for itself,
    carves every buffer it copies from out of it and gives it back with the event that ends its copies; the slot is
    handed out again only after that event. So fetches on several threads at once (the training and the validation
    prefetcher) never write into bytes another fetch is filling or a copy still reads, and no fetch waits on its
    own copies."""

    def __init__(self, copies, slot_bytes: int, slots: int = STAGING_SLOTS):
        self.copies = copies
        self._free: queue.Queue = queue.Queue()
        for _ in range(slots):
            self._free.put(_Slot(copies.pinned(slot_bytes) if slot_bytes else None))

    @contextlib.contextmanager
    def slot(self):
        """A slot no copy reads any more and no other fetch holds (blocks until there is one); given back, with
        the event of its copies (``done``, which the caller sets inside), on exit."""
        slot = self._free.get()
        if slot.done is not None:
            slot.done.synchronize()
        slot.used, slot.done = 0, None
        try:
            yield slot
        finally:
            self._free.put(slot)


class DeviceToHost:
    """Device tensors into pinned host buffers, copied on a side stream (GPU): the issuing thread goes on, whoever
    reads the host tensor first calls ``landed``. One buffer per key (a STEM layer), reserved before the first step
    (``reserve``); a step's update is done with its gradients before the next step's land in it (the first part
    of CPU Adam reads them in place, the rest's are set aside). On CPU the tensor is already on the host."""

    def __init__(self, device: torch.device):
        self.copies = CudaCopies(device) if device.type == "cuda" else None
        self._buffers: dict = {}

    def reserve(self, key, nbytes: int) -> None:
        if self.copies is not None and nbytes:
            self._buffers[key] = self.copies.pinned(nbytes)

    def copy(self, tensor: torch.Tensor, key) -> tuple[torch.Tensor, Optional[torch.cuda.Event]]:
        """(the host tensor, the event ending its copy; None on CPU)."""
        if self.copies is None:
            return tensor, None
        nbytes = tensor.numel() * tensor.element_size()
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < nbytes:  # not reserved this large: grows once
            buffer = self._buffers[key] = self.copies.pinned(max(nbytes, 1))
        host = buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
        self.copies.side.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor's producers first
        with self.copies.stream():
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self.copies.side)  # its memory is not reused before the copy ends
            done = self.copies.record()
        return host, done


def landed(event: Optional[torch.cuda.Event]) -> None:
    """Block this thread (not the device) until a ``DeviceToHost`` copy is on the host."""
    if event is not None:
        event.synchronize()


def staging_bytes(layers: int, rows: int, cols: int, itemsize: int, tokens: int) -> int:
    """The most pinned bytes one fetch stages (a ``StagingPool`` slot): ``rows`` distinct ids (at most min(V,
    tokens)) of every layer's ``cols`` in ``itemsize`` bytes, the inverse index of its ``tokens`` and their order
    by row (``RowOrder``: tokens and rows), the ids' positions in their step and, with a hot-row cache, the hits'
    and misses' positions (int64), each aligned."""
    return layers * rows * cols * itemsize + (2 * tokens + 5 * rows) * 8 + (layers + 7) * ALIGN


def cache_staging_bytes(rows: int, cols: int, itemsize: int) -> int:
    """The pinned bytes a hot-row cache reload stages at once: one layer's ``rows`` (``HotRowCache.reload``)."""
    return staging_bytes(1, rows, cols, itemsize, 0) if rows else 0


def working_set_bytes(rows: int, cols: int, tokens: int) -> tuple[int, int]:
    """The pinned bytes a working set reserves for ``rows`` rows entering or leaving at once (``WorkingSet``): each
    of its staging slots, for one layer's entering rows (fp32 master and both moments) or a training fetch's indices
    (``tokens`` a micro-batch), and each of its leaving rows' landing buffers (one a layer and kind of state)."""
    slot = max(staging_bytes(3, rows, cols, 4, 0), staging_bytes(0, min(rows, tokens), cols, 0, tokens))
    return slot, rows * cols * 4


def staged_rows(moving_rows: int, layers: int) -> int:
    """The most entering rows a layer a working set stages ahead (``staged_rows.StagedRows``): its ``moving_rows``
    spread over its ``layers``, so that their pinned state (fp32 master and both moments of every layer) takes as
    many bytes as one of its staging slots."""
    return moving_rows // max(1, layers)


def staged_bytes(rows: int, layers: int, cols: int) -> int:
    """The pinned bytes of ``rows`` rows staged ahead (``staged_rows.StagedRows``): every layer's fp32 master and
    both moments."""
    return layers * 3 * rows * cols * 4


def landing_rows(ownership: RowOwnership, step_ids: int) -> int:
    """The most rows whose gradients this rank receives in a step (per layer): its peer class's rows of its
    node's range, and no more than the DP group's distinct ids of a step (``step_ids`` bounds them)."""
    return min(ownership.my_local().numel(), step_ids)


def pinned_block_bytes(nbytes: int) -> int:
    """The bytes pinned for a request of ``nbytes`` (``CudaCopies.pinned``): torch's CachingHostAllocator rounds each
    block up to a power of two (unless ``pinned_max_round_threshold_mb`` in ``PYTORCH_ALLOC_CONF``, unset by default,
    exempts it), so a 1.25 GiB staging slot pins 2 GiB."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def pinned_pool_bytes() -> int:
    """The bytes torch's CachingHostAllocator holds now (what ``pinned_block_bytes`` predicts it grows by). torch
    reports no statistics (``{}``) until CUDA is initialised, so it is initialised first."""
    torch.cuda.init()
    return torch.cuda.host_memory_stats()["allocated_bytes.current"]


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
    """The copy engine's side of fetches: a side stream and pinned staging (``StagingPool``) on GPU,
    nothing on CPU. Each fetch's copies go through ``transfer()``, which gives the fetch a staging slot of its
    own, so fetches on several threads never share bytes.

    The hot-row cache is reloaded through transfers too (``cache.HotRowCache.reload``), so its rows are written
    and read on the side stream alone, in issue order: a fetch never reads cached rows from before the step.
    """

    def __init__(self, device: torch.device, dtype: Optional[torch.dtype] = None, slot_bytes: int = 0, copies=None):
        """``dtype``: the precision rows travel in where it is narrower than the table's (the model's compute
        dtype; None: the table's). ``slot_bytes``: a fetch's staging, planned (``staging_bytes``; 0: sized
        by the first fetches). ``copies``: the copy engine (default: ``CudaCopies`` on GPU, none on CPU)."""
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
        raise RuntimeError("a micro-batch holds token ids its step did not announce (RowPipeline)")
    return at
