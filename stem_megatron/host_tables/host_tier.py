"""The host tier: the rows a step reads are fetched from this node's copy and updated on the host (docs/host_tables.md).

A micro-batch's rows are gathered from the node's copy on the prefetch thread and copied to the device
(``transfer.fetch_rows``); the hottest come from the hot-row cache's device copies instead (``HotRowCache``, paper
§3.1.1). After the clip, CPU Adam updates the rows this rank owns in two parts on the Adam thread: first the rows any
rank of the DP group reads next (its announced ids and the cache's), which the training thread waits for, after which
those rows are pulled across nodes (``HostRecord.pull``) and the cache is re-read; then the rest, beside the next step's
forward and backward (``host_tables.overlap_update``). Adam is per row, so the order changes no bit: rows read in step
s+1 reflect step s exactly as in the serial order.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from stem_megatron.host_tables.exchange import RowExchange
from stem_megatron.host_tables.hot_rows import HotRowCache
from stem_megatron.host_tables.row_optimizer import RowOptimizer
from stem_megatron.host_tables.row_state import HostRecord
from stem_megatron.host_tables.transfer import (DeviceToHost, HostToDevice, PrefetchedRows, fetch_rows, landed,
                                                travel_dtype)

Grads = dict  # layer -> (ids this rank updates, their gradients, the event ending their copy to the host)


class HostTier:
    """Rows read from ``record``'s node copy (``cache``: the hot rows from the device) and updated there by
    ``optimizer`` on the Adam thread (``updates``)."""

    def __init__(self, record: HostRecord, exchange: RowExchange, optimizer: RowOptimizer, updates, counters: dict,
                 h2d: HostToDevice, cache: HotRowCache, landing_rows: int = 0):
        """``updates``: the Adam thread (``adam_thread.RowUpdates``); ``counters``: the store's step counters;
        ``landing_rows``: the most rows this rank updates in a step (``transfer.landing_rows``), whose pinned landing
        buffers for their gradients are reserved here (GPU)."""
        self.record, self.exchange, self.optimizer, self.updates = record, exchange, optimizer, updates
        self.counters, self.h2d, self.cache = counters, h2d, cache
        self.layers, self.cols = record.layers, record.cols
        self.parts = []  # parts with counters of their own
        self.row_bytes = row_bytes(record, h2d)
        self._d2h = DeviceToHost(optimizer.device)
        for layer in self.layers:
            self._d2h.reserve(layer, landing_rows * self.cols * 4)
        self._aside: dict = {}  # layer -> the later part's gradients, out of the landing buffer (``_set_aside``)

    # ---- the prefetch thread ----
    def fetch(self, tokens: torch.Tensor, step_ids: torch.Tensor | None, training: bool = True) -> PrefetchedRows:
        """Rows ``U_l[unique ids, my columns]`` of every layer for ``tokens``, from the node's copy (made current for
        them before the prefetch thread was released), on their way to the device."""
        return fetch_from_copy(self.record, tokens, step_ids, self.cache, self.h2d, self.row_bytes)

    # ---- the training thread ----
    def read(self, layer: int, prefetched: PrefetchedRows) -> torch.Tensor:
        return prefetched.fetched.rows[layer]

    def planned(self, ids: torch.Tensor) -> tuple[list, torch.Tensor]:
        """(a step of the sorted ``ids`` begins) The routes of its rows to their owners and the ids this rank updates,
        planned now (``RowExchange.plan``: a collective over the exchange groups' gloo twins)."""
        return self.exchange.plan(ids)

    def land(self, layer: int, grads: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.cuda.Event]]:
        """A layer's gradients at their owners (on the device) on their way to the host, where CPU Adam updates the
        rows: pinned buffers on a side stream; the update is done with them before the next step's land."""
        self.counters["bytes_from_device"] += grads.numel() * grads.element_size()
        return self._d2h.copy(grads, layer)

    def admit(self, ids: torch.Tensor) -> None:
        """A step's rows current in the node's copy, where this tier reads them (``make_current``)."""
        make_current(self, ids)

    def update(self, step: int, lr: float, grads: Grads, next_ids: torch.Tensor) -> Callable[[], None]:
        """CPU Adam on the rows this rank owns, those any rank of the DP group reads next first (waited for), then the
        node's copy of the next step's rows pulled from their owners and the cache re-read. Returns the rest's update,
        for the Adam thread beside the next step."""
        record, own, dense = self.record, self.record.own, self.optimizer.dense
        self.cache.choose(step)
        reads = torch.cat([next_ids, self.cache.ids])
        read_next = self._read_next(reads)
        first, rest, updated = [], [], torch.empty(0, dtype=torch.int64)
        if dense:  # every row this rank owns, the same for every layer
            rows = own.my_local()
            now = read_next[own.ids_at(own.lo + rows)]
        for layer in self.layers:
            ids, layer_grads, event = grads.pop(layer, (torch.empty(0, dtype=torch.int64),
                                                        torch.empty(0, self.cols), None))
            landed(event)
            updated = torch.unique(torch.cat([updated, ids]))
            local, read = own.local(ids), read_next[ids]
            order = torch.argsort(local + (~read) * record.vocab_size)  # rows read next first, each part by row
            local, k = local[order], int(read.sum())  # the gradients stay as they landed: ``order`` finds them
            parts = ((rows[now], rows[~now]) if dense else (local[:k], local[k:]))
            first.append((layer, parts[0], local[:k], layer_grads, order[:k]))
            rest.append((layer, parts[1], local[k:], layer_grads, order[k:]))
            self.counters["rows_updated"] += parts[0].numel() + parts[1].numel()
            self.counters["rows_updated_later"] += parts[1].numel()

        def update_now() -> None:
            """The first part, then the rest's gradients out of the landing buffers (the next step's land there) into
            buffers kept from step to step, on the same thread and its cores."""
            self._update(step, lr, first)
            rest[:] = [(layer, rows, local, self._set_aside(layer, g, at), None) for layer, rows, local, g, at in rest]

        self.updates.now(update_now)
        if self.layers:
            if dense:
                record.current.fill_(False)  # every row changed (the owned ones are never asked for)
            else:
                record.current[self.exchange.updated_elsewhere(updated)] = False
        self.counters["rows_pulled"] += record.pull(reads, self.exchange)
        self.cache.reload(record.read, self.h2d, own.position)
        return lambda: self._update(step, lr, rest)

    def settle(self) -> None:
        """The last step's CPU Adam done (the host record is where rows are updated)."""
        self.updates.settle()

    def drop(self, steps_done: int | None = None) -> None:
        """The host record was loaded anew (after ``steps_done`` steps: a checkpoint): the cached rows chosen again
        for that step and re-read."""
        if steps_done is not None:
            self.cache.choose(steps_done)
        self.cache.reload(self.record.read, self.h2d, self.record.own.position)

    def _read_next(self, ids: torch.Tensor) -> torch.Tensor:
        """Over token ids: True where any rank of the DP group reads the row in the next step (every row without
        ``host_tables.overlap_update``: one part, the serial order). Collective over the DP group."""
        if not self.updates.overlapped:
            return torch.ones(self.record.vocab_size, dtype=torch.bool)
        return self.exchange.read_anywhere(ids, self.record.vocab_size)

    def _set_aside(self, layer: int, grads: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """``grads[at]`` in this layer's buffer for the later part, grown when too small (a fresh tensor each step
        would fault its pages in on the step's path)."""
        buffer = self._aside.get(layer)
        if buffer is None or buffer.shape[0] < at.numel():
            buffer = self._aside[layer] = torch.empty(at.numel(), self.cols)
        return torch.index_select(grads, 0, at, out=buffer[:at.numel()])

    def _update(self, step: int, lr: float, parts: list) -> None:
        """AdamW per ``(layer, rows, local, grads, at)``: on ``rows`` (sorted, of the node's master block), gradient
        ``grads[at[i]]`` for ``local[i]`` (sorted, among ``rows``), zero for the others (dense); then the node's copy of
        them rounded."""
        for layer, rows, local, grads, at in parts:
            if not rows.numel():
                continue
            untouched = rows[:0]
            if rows.numel() != local.numel():
                mask = torch.ones(rows.numel(), dtype=torch.bool)
                mask[torch.searchsorted(rows, local)] = False
                untouched = rows[mask]
            self.optimizer.update(step, lr, self.record.state, layer, local, grads, at, untouched)
            self.record.round_copies(layer, rows)


def row_bytes(record: HostRecord, h2d: HostToDevice) -> int:
    """Bytes of one row of one layer as fetched rows travel (the compute dtype where narrower than the copy's)."""
    return record.cols * travel_dtype(record.read_dtype, h2d.dtype).itemsize


def fetch_from_copy(record: HostRecord, tokens: torch.Tensor, step_ids: torch.Tensor | None, cache: HotRowCache,
                    h2d: HostToDevice, row_bytes: int) -> PrefetchedRows:
    """The host tier's fetch (and validation's, whatever the tier): ``tokens``' rows from ``record``'s node copy, the
    cached ones from ``cache``, with the fetch's counters."""
    prefetched, hit = fetch_rows(tokens, record.vocab_size, record.read, cache, h2d, at=record.own.position,
                                 step_ids=step_ids)
    uniq, misses, layers = prefetched.uniq.numel(), int((~hit).sum()), len(record.layers)
    prefetched.fetched.stats.update(
        unique_tokens=uniq, rows_fetched=misses * layers, bytes_to_device=misses * row_bytes * layers,
        cache_hits=uniq - misses, cache_lookups=uniq if cache.ids.numel() else 0)
    return prefetched


def settle_node(tier) -> None:
    """``tier``'s updates in the host record (``settle``), then on this rank's DP peers on the node, which share its
    copy of this TP block (a collective over them: ``node.local``)."""
    tier.settle()
    if tier.record.node.local is not None:
        dist.barrier(tier.record.node.local)


def make_current(tier, ids: torch.Tensor) -> None:
    """This node's copy of rows ``ids`` made equal to the owners' rows, after ``tier``'s updates are in the host record
    (``settle_node``). Collective over the world's ranks of this stage's DP group and the node."""
    settle_node(tier)
    tier.counters["rows_pulled"] += tier.record.pull(ids, tier.exchange)
