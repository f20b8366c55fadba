"""Moving STEM rows from host memory to the compute device, selected by device.

On GPU the rows are gathered into pinned memory and copied on a side stream, so the copy overlaps the
compute of the current micro-batch; the consumer's stream waits on an event before using them. On CPU
the gathered rows are already where compute happens: no copy, no event. Rows held by the hot-row
cache come from its device copies instead of host memory. Training (``store``) and inference
(``read_only``) fetch through ``fetch_rows``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from stem_megatron.data.integrity import check_token_ids


@dataclass
class Fetched:
    """A micro-batch's rows per STEM layer, the event marking their arrival, and fetch counters."""

    rows: dict[int, torch.Tensor]
    ready: Optional[torch.cuda.Event]
    stats: dict

    def wait(self) -> None:
        """Make the current stream wait for the copy (GPU); a no-op on CPU."""
        if self.ready is None:
            return
        stream = torch.cuda.current_stream()
        stream.wait_event(self.ready)
        for t in self.rows.values():
            t.record_stream(stream)


@dataclass
class PrefetchedRows:
    """What a host-resident STEM layer needs for one micro-batch."""

    uniq: torch.Tensor  # sorted unique token ids
    inverse: torch.Tensor  # [b, s]: position of each token's id in ``uniq``
    fetched: Fetched


class HostToDevice:
    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def stream(self):
        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()

    def copy(self, rows: torch.Tensor) -> torch.Tensor:
        if self.side is None:
            return rows
        return rows.pin_memory().to(self.device, non_blocking=True)

    def record(self) -> Optional[torch.cuda.Event]:
        if self.side is None:
            return None
        event = torch.cuda.Event()
        event.record(self.side)
        return event


def fetch_rows(tokens: torch.Tensor, vocab_size: int, tables: Mapping[int, torch.Tensor], cache,
               h2d: HostToDevice) -> tuple[PrefetchedRows, torch.Tensor]:
    """The rows a forward over ``tokens`` ([b, s]) needs: ``table[unique ids]`` of every ``{layer: [V,
    cols] host table}`` on the device. Ids the ``HotRowCache`` holds come from its device rows, the
    others are gathered from host memory (only the distinct ids). The ids are range-checked here,
    before any lookup, and not again in the forward (``token_context``).

    Returns the rows (``fetched.stats`` empty, for the caller's counters) and the hit mask over the ids.
    """
    check_token_ids(tokens, vocab_size)
    uniq, inverse, counts = torch.unique(tokens.cpu(), return_inverse=True, return_counts=True)
    cache.observe(uniq, counts)
    hit, pos = cache.split(uniq)
    miss = uniq[~hit]
    any_hit = bool(hit.any())
    rows = {}
    with h2d.stream():
        hit_d = hit.to(h2d.device, non_blocking=True)
        for layer, table in tables.items():
            fetched = h2d.copy(table.index_select(0, miss))
            if any_hit:
                out = torch.empty(uniq.numel(), table.shape[1], dtype=table.dtype, device=h2d.device)
                out[hit_d] = cache.rows[layer][pos.to(h2d.device)]
                out[~hit_d] = fetched
                fetched = out
            rows[layer] = fetched
        ready = h2d.record()
    inverse = inverse.to(h2d.device, non_blocking=True)
    return PrefetchedRows(uniq, inverse, Fetched(rows, ready, {})), hit
