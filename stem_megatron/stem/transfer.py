"""Host-to-device row transfer, selected by device.

On GPU the prefetch thread gathers rows into pinned memory and copies them on a side stream, so the
copy overlaps the compute of the current micro-batch; the consumer's stream waits on an event before
using them. On CPU the gathered rows are already where compute happens: no copy, no event.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch


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
