"""What a tier is to the pipeline and the store: where the rows a step reads live and are updated (docs/host_tables.md,
"Tier"). The store chooses one at build: ``host_tier.HostTier``, or a working set's ``device_tier.DeviceTier`` (DP = 1)
or ``device_tier.OwnerTier`` (DP > 1), which also work on the prefetch thread (``LoadsAhead``, ``PlansAhead``: the
store runs them in ``pipeline.PreloadPipeline`` and ``pipeline.PlannedPipeline``)."""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch

from stem_megatron.host_tables.exchange import RowExchange
from stem_megatron.host_tables.row_state import HostRecord
from stem_megatron.host_tables.transfer import PrefetchedRows


class Tier(Protocol):
    parts: list  # its parts with counters of their own (``take_stats``)
    record: HostRecord  # the node's host record, whose copy ``host_tier.make_current`` makes current
    exchange: RowExchange
    counters: dict  # the store's step counters

    def fetch(self, tokens: torch.Tensor, step_ids: Optional[torch.Tensor], training: bool = True) -> PrefetchedRows:
        """(prefetch thread) A micro-batch's rows (or where they are) on their way to the device."""

    def read(self, layer: int, prefetched: PrefetchedRows) -> torch.Tensor:
        """(forward) A micro-batch's rows of ``layer``, fp32."""

    def planned(self, ids: torch.Tensor) -> tuple[list, torch.Tensor]:
        """(a step begins) The routes of its rows to their owners and the ids this rank updates."""

    def land(self, layer: int, grads: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.cuda.Event]]:
        """A layer's gradients at their owners taken to where the rows are updated, with the event ending the copy."""

    def admit(self, ids: torch.Tensor) -> None:
        """A training step's rows readable where the tier reads them, the node's copy of them current first."""

    def update(self, step: int, lr: float, grads: dict, next_ids: torch.Tensor) -> Callable[[], None]:
        """Adam step ``step`` on the rows this rank owns, the next step's rows readable; returns the rest of the work,
        for the Adam thread beside the next step."""

    def settle(self) -> None:
        """Every update done and in the host record (checkpoints, export, whole tables)."""

    def drop(self, steps_done: Optional[int] = None) -> None:
        """The host record was loaded anew (after ``steps_done`` steps: a checkpoint)."""


class LoadsAhead(Tier, Protocol):
    def preload(self, ids: torch.Tensor) -> None:
        """(prefetch thread) Rows a training step reads, loaded where the tier reads them while the step before runs."""


class PlansAhead(LoadsAhead, Protocol):
    def begin_planning_ahead(self) -> None:
        """(training thread, a training stream opens) From now on the prefetch thread plans each step."""

    def plan_ahead(self, ids: torch.Tensor) -> None:
        """(prefetch thread) The plan of a training step of the sorted ``ids``, made as it is announced."""

    def end_planning_ahead(self) -> None:
        """(training thread, the stream closes) Plans not taken are dropped."""
