"""megatron-core's ``ChainedOptimizer`` whose step applies nothing where the gradients' norm is not finite.

megatron skips an update on a non-finite gradient only through a loss scaler's found-inf check (fp16); an fp32 or
bf16 run without one applies a NaN norm's clip and update (a NaN is above no ``grad_norm_skip_threshold``). Every
rank holds the same norm (megatron all-reduces it), so every rank skips alike and no collective changes order.
"""

from __future__ import annotations

import math

import torch
from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer

from stem_megatron.host_tables.placement import NoTables


class FiniteChain(ChainedOptimizer):
    """megatron's chain of ``members``, the dense optimizer first; a step whose norm is not finite changes no weight or
    optimizer state. ``tables``: the host tables' member (``TableChain``), here their absence."""

    tables = NoTables()

    def __init__(self, members: list):
        super().__init__(members)
        self._norm = 0.0  # the step's norm (``get_grad_norm``)

    @property
    def dense(self) -> MegatronOptimizer:
        """The dense parameters' optimizer: its state is the dense checkpoint's (``checkpoint/dense.py``)."""
        return self.chained_optimizers[0]

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        self._norm = super().get_grad_norm()
        return self._norm

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Every member's update, none where the norm is not finite."""
        return math.isfinite(self._norm) and super().step_with_ready_grads()

    @torch.no_grad()
    def skip(self) -> tuple[bool, None, None]:
        """A step not to apply whatever its gradients (a loss that is not finite, ``train.skip_steps``), returned as
        megatron returns one; the next step's ``zero_grad`` drops its gradients."""
        return False, None, None
