"""Pinned host memory for STEM rows crossing to and from the GPU, sized before the first step.

Fetched rows are gathered into pinned staging (``StagingPool``) and copied to the device on a side stream; a
step's row gradients land in pinned buffers (``DeviceToHost``) on another side stream; a working set's entering and
leaving rows pass through its own of both, and its rows staged ahead through a buffer of their own. All are allocated
when the store is built, at the sizes the memory plan counts (``staging_bytes``, ``landing_rows``,
``working_set_bytes``, ``staged_bytes``; ``flops/memory.py`` uses the same functions), because pinning memory
(``cudaHostAlloc``) is slow and synchronises the device: done in the middle of a step it would stall it. A request
larger than planned (inference's batches, a store built without its batch sizes) grows its buffer once.

``CudaCopies`` is torch's side of it: a side stream, pinned allocations, events. Tests on a machine without a GPU
pass a stand-in with the same methods whose copies run late on a thread of their own, as a copy engine's do.
"""

from __future__ import annotations

import contextlib
import math
import queue
from typing import Optional

import torch

from stem_megatron.host_tables.ownership import RowOwnership

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
    (``reserve``); ``store.step`` is done with a step's gradients before the next step's land in it (the first part
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
