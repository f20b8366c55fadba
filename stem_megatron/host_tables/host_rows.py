"""The host record a working set reads rows from and writes them back to (issue 31): one rank's fp32 masters and Adam
moments, and the node's copy that fetches read. Its own module because the working set, its staged rows and the
store's side of it all take it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

KINDS = ("master", "exp_avg", "exp_avg_sq")  # a row's state: its fp32 master and both Adam moments


@dataclass
class HostRows:
    """The host record of one rank's rows: per layer the fp32 masters and moments (``local(ids)`` rows) and the
    copy fetches read (``position(ids)`` rows, ``read_dtype``)."""

    master: dict[int, torch.Tensor]
    exp_avg: dict[int, torch.Tensor]
    exp_avg_sq: dict[int, torch.Tensor]
    weight: dict[int, torch.Tensor]
    local: Callable[[torch.Tensor], torch.Tensor]
    position: Callable[[torch.Tensor], torch.Tensor]

    def kind(self, name: str) -> dict[int, torch.Tensor]:
        return getattr(self, name)
