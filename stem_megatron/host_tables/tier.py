"""What a tier is to the pipeline and the store: where the rows a step reads live and are updated (docs/host_tables.md,
"Tier"). Two implement it, the store choosing one at build: ``host_tier.HostTier`` and ``device_tier.DeviceTier``."""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch

from stem_megatron.host_tables.transfer import PrefetchedRows


class Tier(Protocol):
    parts: list  # its parts with counters of their own (``take_stats``)

    # ---- the prefetch thread ----
    def begin_planning_ahead(self) -> bool:
        """(training thread, a training stream opens) Whether the prefetch thread plans each step (``plan_ahead``)."""

    def end_planning_ahead(self) -> None:
        """(training thread, the stream closes) Plans not taken are dropped."""

    def plan_ahead(self, ids: torch.Tensor) -> torch.Tensor:
        """A step of the sorted ``ids`` announced: its plan made here where the tier plans ahead; returns the ids whose
        rows this rank loads (``preload``)."""

    def preload(self, ids: torch.Tensor) -> None:
        """Rows a step reads, loaded where the tier reads them while the step before runs."""

    def fetch(self, tokens: torch.Tensor, step_ids: Optional[torch.Tensor], training: bool = True) -> PrefetchedRows:
        """A micro-batch's rows (or where they are) on their way to the device."""

    # ---- the training thread ----
    def read(self, layer: int, prefetched: PrefetchedRows) -> torch.Tensor:
        """(forward) A micro-batch's rows of ``layer``, fp32."""

    def planned(self, ids: torch.Tensor) -> tuple[list, torch.Tensor]:
        """(a step begins) The routes of its rows to their owners and the ids this rank updates."""

    def admit(self, ids: torch.Tensor) -> None:
        """A step's rows readable where the tier reads them (after the node's copy was made current)."""

    def update(self, step: int, lr: float, grads: dict, next_ids: torch.Tensor) -> Callable[[], None]:
        """Adam step ``step`` on the rows this rank owns, the next step's rows readable; returns the rest of the work,
        for the Adam thread beside the next step."""

    def settle(self) -> None:
        """Every update done and in the host record (checkpoints, export, whole tables)."""

    def drop(self, steps_done: Optional[int] = None) -> None:
        """The host record was loaded anew (after ``steps_done`` steps: a checkpoint)."""
