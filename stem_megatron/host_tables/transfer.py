"""Moving STEM rows from host memory to the compute device, selected by device.

On GPU the rows are gathered straight into reusable pinned staging buffers (``PinnedStaging``: no
pageable copy, no pinned allocation per fetch) and copied on a side stream, so the copy overlaps the
compute of the current micro-batch; the consumer's stream waits on an event before using them. Rows
travel in the model's compute precision (bf16 on GPU): the layer casts its fp32 row leaf to that dtype
before any use, so rounding on the host first changes no value and halves the bytes. On CPU the gathered
rows are already where compute happens: no copy, no event. Rows held by the hot-row cache come from its
device copies instead of host memory. Training (``store``) and inference (``read_only``) fetch through
``fetch_rows``.

The other way, a step's row gradients land in reusable pinned host buffers (``DeviceToHost``), copied on a
side stream that the CPU optimizer's thread waits for, never the training thread.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch

from stem_megatron.data.integrity import check_token_ids


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

    def wait(self) -> None:
        """Make the current stream wait for the rows and the inverse index (GPU); a no-op on CPU."""
        if self.fetched.ready is None:
            return
        stream = torch.cuda.current_stream()
        stream.wait_event(self.fetched.ready)
        for t in (*self.fetched.rows.values(), self.inverse, *([self.in_step] if self.in_step is not None else [])):
            t.record_stream(stream)  # allocated on the side stream, used on this one


class PinnedStaging:
    """A ring of reusable pinned host buffers for host-to-device copies. A buffer is handed out again only
    after its previous copy finished (its event), so a gather never overwrites bytes still in flight;
    buffers grow to the largest request and are then reused, so steady state allocates nothing.
    ``allocate`` and ``event`` are torch's (pinned memory, CUDA events) unless a test passes stand-ins."""

    def __init__(self, count: int, allocate=None, event=None):
        self._allocate = allocate or (lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
        self._event = event or torch.cuda.Event
        self._buffers: list[Optional[torch.Tensor]] = [None] * count
        self._events: list = [None] * count
        self._next = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """(slot, a pinned tensor of ``shape``) that no copy in flight still reads."""
        slot, self._next = self._next, (self._next + 1) % len(self._buffers)
        if self._events[slot] is not None:
            self._events[slot].synchronize()
        nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
        if self._buffers[slot] is None or self._buffers[slot].numel() < nbytes:
            self._buffers[slot] = self._allocate(max(nbytes, 1))
        return slot, self._buffers[slot][:nbytes].view(dtype).view(shape)

    def used(self, slot: int, stream=None) -> None:
        """Mark the end of the copy out of ``slot`` (recorded on ``stream``, the side stream)."""
        self._events[slot] = self._event()
        self._events[slot].record(stream)


class HostToDevice:
    """The copy engine's side of a fetch: a side stream and pinned staging on GPU, nothing on CPU.

    The hot-row cache is written on the training stream (after an optimizer step) and read on the side
    stream (by the next fetch): ``cache_written`` marks the end of the writes with an event that
    ``wait_for_cache`` makes the side stream wait for, so a fetch never reads rows from before the step.
    """

    def __init__(self, device: torch.device, staging_buffers: int = 8, dtype: Optional[torch.dtype] = None):
        """``dtype``: the precision rows travel in where it is narrower than the table's (the model's compute
        dtype; None: the table's)."""
        self.device, self.dtype = device, dtype
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.staging = PinnedStaging(staging_buffers) if self.side is not None else None
        self._cache_event: Optional[torch.cuda.Event] = None

    def stream(self):
        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()

    def cache_written(self) -> None:
        """Call after writing the hot-row cache on the current stream, before publishing the new rows."""
        if self.side is not None:
            self._cache_event = torch.cuda.Event()
            self._cache_event.record()

    def wait_for_cache(self) -> None:
        """Inside ``stream()``: later work on the side stream waits for the last cache writes."""
        if self._cache_event is not None:
            self.side.wait_event(self._cache_event)

    def gather(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``table[ids]`` on the device: on GPU gathered into a staging buffer and copied from there (inside
        ``stream()``)."""
        dtype = travel_dtype(table.dtype, self.dtype)
        if self.side is None:
            return table.index_select(0, ids).to(dtype)
        slot, staged = self.staging.take((ids.numel(), *table.shape[1:]), dtype)
        if dtype == table.dtype:
            torch.index_select(table, 0, ids, out=staged)
        else:
            staged.copy_(table.index_select(0, ids))
        return self._send(slot, staged)

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device (inside ``stream()``), through a staging buffer on GPU."""
        if self.side is None:
            return tensor
        slot, staged = self.staging.take(tuple(tensor.shape), tensor.dtype)
        staged.copy_(tensor)
        return self._send(slot, staged)

    def _send(self, slot: int, staged: torch.Tensor) -> torch.Tensor:
        out = staged.to(self.device, non_blocking=True)
        self.staging.used(slot, self.side)
        return out

    def record(self) -> Optional[torch.cuda.Event]:
        if self.side is None:
            return None
        event = torch.cuda.Event()
        event.record(self.side)
        return event


def travel_dtype(table: torch.dtype, compute: Optional[torch.dtype]) -> torch.dtype:
    """The dtype rows cross to the device in: the compute dtype where it is narrower than the table's."""
    return compute if compute is not None and compute.itemsize < table.itemsize else table


class DeviceToHost:
    """Device tensors into reusable pinned host buffers, copied on a side stream (GPU): the training
    thread issues the copy and goes on; whoever reads the host tensor first calls ``landed``. Buffers are
    keyed by the caller (a layer, a part, the step's parity: the optimizer may still read last step's
    while this step's land) and grow to the largest request. On CPU the tensor is already on the host."""

    def __init__(self, device: torch.device):
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._buffers: dict = {}

    def copy(self, tensor: torch.Tensor, key) -> tuple[torch.Tensor, Optional[torch.cuda.Event]]:
        """(the host tensor, the event ending its copy; None on CPU)."""
        if self.side is None:
            return tensor, None
        nbytes = tensor.numel() * tensor.element_size()
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._buffers[key] = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
        host = buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
        self.side.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor's producers first
        with torch.cuda.stream(self.side):
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self.side)  # its memory is not reused before the copy ends
            landed = torch.cuda.Event()
            landed.record(self.side)
        return host, landed


def landed(event: Optional[torch.cuda.Event]) -> None:
    """Block this thread (not the device) until a ``DeviceToHost`` copy is on the host."""
    if event is not None:
        event.synchronize()


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
    with h2d.stream():  # every copy below is issued on the side stream (GPU)
        if any_hit:  # positions of hits and misses among the ids, computed here: no mask indexing on the device
            h2d.wait_for_cache()
            hit_at, miss_at, pos = (h2d.copy(t) for t in (hit.nonzero().squeeze(1), (~hit).nonzero().squeeze(1), pos))
        rows_at = miss if at is None else at(miss)
        for layer, table in tables.items():
            fetched = h2d.gather(table, rows_at)
            if any_hit:
                out = torch.empty(uniq.numel(), table.shape[1], dtype=fetched.dtype, device=h2d.device)
                out.index_copy_(0, hit_at, cache.rows[layer].index_select(0, pos).to(fetched.dtype))
                out.index_copy_(0, miss_at, fetched)
                fetched = out
            rows[layer] = fetched.float()  # the layer's row leaf: gradients sum in fp32
        inverse = h2d.copy(inverse)
        in_step = None if step_ids is None else h2d.copy(_positions(step_ids, uniq))
        ready = h2d.record()
    return PrefetchedRows(uniq, inverse, Fetched(rows, ready, {}), in_step), hit


def _positions(step_ids: torch.Tensor, uniq: torch.Tensor) -> torch.Tensor:
    """Where each of ``uniq`` sits in the sorted ``step_ids``, which must hold them all."""
    at = torch.searchsorted(step_ids, uniq)
    if uniq.numel() and (int(at.max()) >= step_ids.numel() or not torch.equal(step_ids[at], uniq)):
        raise RuntimeError("a micro-batch holds token ids its step did not announce (RowPrefetcher)")
    return at
