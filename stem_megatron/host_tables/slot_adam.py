"""AdamW on a working set's slots (``working_set.WorkingSet``, issue 31): DeepSpeed's kernel on CPU, torch's fused
AdamW on GPU.

On CPU the slots run the host path's kernel (``RowAdam``), in place: bitwise the values the host step gives. On
GPU torch's fused AdamW (``torch._fused_adamw_``) runs on the rows gathered by slot and put back: other arithmetic,
equal within fp32 rounding (tests/test_working_set.py states the bound). Both keep today's semantics: bias
correction by the global step, decoupled weight decay; rows without a gradient (dense Adam's) update with a zero
one.
"""

from __future__ import annotations

import torch

from stem_megatron.host_tables.host_rows import KINDS
from stem_megatron.host_tables.row_adam import RowAdam

EMPTY = torch.empty(0, dtype=torch.int64)


class SlotAdam:
    """AdamW in place on slots of a set's ``{kind: [C, cols]}`` state, by ``kernel``: ``rows`` (DeepSpeed's) or
    ``fused`` (torch's)."""

    def __init__(self, adam: RowAdam, kernel: str, device: torch.device):
        if kernel not in ("rows", "fused"):
            raise ValueError(f"working-set kernel must be 'rows' or 'fused', got {kernel!r}")
        self.adam, self.kernel, self.device = adam, kernel, device

    def update(self, step: int, lr: float, state: dict, slots: torch.Tensor, grads: torch.Tensor,
               untouched: torch.Tensor = EMPTY) -> None:
        """Step ``step`` at ``lr`` on ``slots`` (distinct) with ``grads`` (``[len(slots), cols]``, on the device),
        and on ``untouched`` (sorted) with a zero gradient."""
        if self.kernel == "rows":
            order = torch.argsort(slots)
            self.adam.update_rows(step, lr, slots[order], grads, *(state[k] for k in KINDS), grad_rows=order)
            self.decay(step, lr, state, untouched)
            return
        if untouched.numel():
            grads = torch.cat([grads, grads.new_zeros(untouched.numel(), grads.shape[1])])
        at = torch.cat([slots.to(self.device, non_blocking=True), untouched.to(self.device, non_blocking=True)])
        self._fused(step, lr, state, at, grads)

    def decay(self, step: int, lr: float, state: dict, slots: torch.Tensor) -> None:
        """Step ``step`` at ``lr`` on ``slots`` (sorted) with a zero gradient: dense Adam's rows that did not take
        part in the step."""
        if not slots.numel():
            return
        if self.kernel == "rows":
            self.adam.update_untouched_rows(step, lr, slots, *(state[k] for k in KINDS))
        else:
            zeros = state[KINDS[0]].new_zeros(slots.numel(), state[KINDS[0]].shape[1])
            self._fused(step, lr, state, slots.to(self.device, non_blocking=True), zeros)

    def _fused(self, step: int, lr: float, state: dict, slots: torch.Tensor, grads: torch.Tensor) -> None:
        """torch's fused AdamW on the rows at ``slots``: gathered, updated, put back (3x an in-place row kernel's
        traffic, ~10 ms a step at 1B STEM-1/3 on an H100 by the design note)."""
        p, m, v = (state[k].index_select(0, slots) for k in KINDS)
        count = torch.full((), float(step), device=self.device)  # bias correction by the global step
        adam = self.adam
        torch._fused_adamw_([p], [grads.contiguous()], [m], [v], [], [count], lr=lr, beta1=adam.beta1,
                            beta2=adam.beta2, weight_decay=adam.weight_decay, eps=adam.eps, amsgrad=False,
                            maximize=False)
        for kind, rows in zip(KINDS, (p, m, v)):
            state[kind].index_copy_(0, slots, rows)
