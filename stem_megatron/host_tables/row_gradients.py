"""A step's row gradients on their way to the rows' owners (megatron DDP's names, a layer its bucket).

As backward fills a micro-batch's compact row gradient it is added into one fp32 buffer per layer over the step's
distinct ids (in micro-batch order) and the micro-batch's rows are let go (``_register_grad_ready``). Once a layer's
last micro-batch is in, the layer goes to its owners (``_start_grad_sync``: ``RowExchange.to_owners``, averaged over
DP) and lands where the tier updates the rows (the tier's ``land``: the host tier's pinned host buffers on a side
stream): from the hook itself (``host_tables.overlap_exchange``), else after backward (``finish_grad_sync``). Every
rank finishes its layers in one order, so the exchange takes one place among the step's collectives on every rank.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from stem_megatron.host_tables.counters import Counted
from stem_megatron.host_tables.exchange import Route, RowExchange

Landed = tuple[torch.Tensor, torch.Tensor, Optional[torch.cuda.Event]]  # (ids, gradients, their copy's end)


class RowGradients(Counted):
    """Per STEM layer, the step's row gradients: merged on the device, exchanged, landed where the tier updates them."""

    def __init__(self, layers: list[int], cols: int, exchange: RowExchange, dp_group, device: torch.device,
                 overlap: bool, land: Callable[[int, torch.Tensor], tuple[torch.Tensor, Optional[torch.cuda.Event]]]):
        """``land``: a layer's gradients at their owners taken to where the tier updates the rows (``Tier.land``)."""
        self.layers, self.cols, self.exchange, self.dp_group, self.device = layers, cols, exchange, dp_group, device
        self.overlap, self.land = overlap, land
        self.stats = self.new_stats()
        self._routes: Optional[list[Route]] = None  # the step's rows on their way to the owners; None: no step
        self._owned = torch.empty(0, dtype=torch.int64)  # the sorted ids this rank updates in the step
        self._size = self._micro_batches = 0  # the step's distinct ids, its micro-batches
        self._merged: dict[int, torch.Tensor] = {}  # layer -> [step's distinct ids, cols] fp32 on the device
        self._filled = dict.fromkeys(layers, 0)
        self._sent: dict[int, tuple[Landed, torch.Tensor]] = {}  # layers sent from backward
        self._held = 0  # device bytes of registered rows and merged gradients

    @staticmethod
    def new_stats() -> dict:
        """``device_row_bytes_peak``: the most device bytes the step held in row leaves registered by the
        forward and not yet merged, their gradient being merged and the merged buffers (the memory plan's
        ``step_rows`` less the prefetcher's queue). ``exchange_wait_s``: the step's wait after backward for
        layers not sent during it."""
        return dict(layers_sent_in_backward=0, exchange_wait_s=0.0, device_row_bytes_peak=0)

    def _hold(self, nbytes: int, transient: int = 0) -> None:
        self._held += nbytes
        self.stats["device_row_bytes_peak"] = max(self.stats["device_row_bytes_peak"], self._held + transient)

    def begin(self, ids: torch.Tensor, micro_batches: int, plan: tuple[list[Route], torch.Tensor]) -> None:
        """A step of ``micro_batches`` reading the sorted distinct ``ids`` starts, its rows' routes to the owners and
        the ids this rank updates ``plan``ned (``RowExchange.plan``: the tier's ``planned``)."""
        self._routes, self._owned = plan
        self._size, self._micro_batches = ids.numel(), micro_batches
        self._filled = dict.fromkeys(self.layers, 0)

    def track(self, layer: int, in_step: Optional[torch.Tensor], rows: torch.Tensor) -> None:
        """(forward) Merge ``rows.grad`` into the step's buffer of ``layer`` when backward fills it;
        ``in_step``: positions of the rows' ids among the step's ids, on the device."""
        if self._routes is None or in_step is None:
            raise RuntimeError("STEM rows were read outside a training step: read the batches through "
                               "HostTableStore.stream, which begins each step and fetches it with its ids")
        rows.register_post_accumulate_grad_hook(functools.partial(self._register_grad_ready, layer, in_step))
        self._hold(rows.numel() * rows.element_size())

    def _register_grad_ready(self, layer: int, in_step: torch.Tensor, rows: torch.Tensor) -> None:
        """Backward hook: add a micro-batch's gradient, free its rows; after the step's last, send the layer."""
        merged = self._merged.get(layer)
        if merged is None:
            merged = self._merged[layer] = torch.zeros(self._size, self.cols, device=self.device)
            self._hold(merged.numel() * 4)
        self._hold(0, transient=rows.grad.numel() * 4)
        merged.index_add_(0, in_step, rows.grad)
        rows.grad = None
        self._hold(-rows.numel() * rows.element_size())  # autograd lets the leaf go with the micro-batch
        self._filled[layer] += 1
        if self.overlap and self._filled[layer] == self._micro_batches:
            self._sent[layer] = self._start_grad_sync(layer)

    def _start_grad_sync(self, layer: int) -> tuple[Landed, torch.Tensor]:
        """Send layer ``layer``'s merged gradients to their owners; returns (the ids this rank updates and
        their DP-averaged gradients, landing where the tier updates them; the squared norm of those rows, on the
        device)."""
        merged = self._merged.pop(layer, None)
        if merged is None:
            raise RuntimeError(f"STEM layer {layer} got no row gradients this step: every micro-batch's backward "
                               f"must reach it before RowPipeline.reduce_gradients()")
        self._hold(-merged.numel() * 4)
        summed = self.exchange.to_owners(self._routes, merged)
        summed /= dist.get_world_size(self.dp_group)
        return (self._owned, *self.land(layer, summed)), summed.pow(2).sum()

    def finish_grad_sync(self) -> tuple[dict[int, Landed], torch.Tensor]:
        """Every layer's gradients at their owners, those sent during backward first; returns them and the
        squared norm of the STEM gradients summed over DP, TP and PP (each row counted once)."""
        start = time.perf_counter()
        self.stats["layers_sent_in_backward"] += len(self._sent)
        out, sq = {}, torch.zeros((), dtype=torch.float32, device=self.device)
        for layer in self.layers:
            out[layer], layer_sq = self._sent.pop(layer) if layer in self._sent else self._start_grad_sync(layer)
            sq += layer_sq
        self._routes = None
        self.stats["exchange_wait_s"] += time.perf_counter() - start
        dist.all_reduce(sq, group=self.dp_group)
        dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
        return out, sq
