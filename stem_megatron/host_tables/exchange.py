"""STEM row traffic between a node's DP peers and between nodes: gradients to owners, fresh rows back.

Everything sent is ids and rows of distinct ids, never tokens, so the bytes grow with distinct ids,
not batch tokens, and no expert all-to-all appears. Two levels (``ownership.RowOwnership``):
- in a node, each row goes to the DP peer of its class, which sums duplicates: a row leaves a node once;
- between nodes, the peers of one class form a "rail" (one rank per node, ordered by node) and send
  each row to its owner node.
A step's gradient rows are the step's distinct ids, the same for every layer, so where each goes is worked out
once a step, on the host over the groups' gloo twins (``plan``: ids only, no device work; with a working set the
prefetch thread plans each step ahead, over gloo groups of its own); each layer's rows then
follow that plan (``to_owners``: one all-to-all per level, split sizes known, nothing to wait for). With a working
set at DP > 1 the owners send the updated rows back along the same plan reversed (``from_owners``). Rows run on
the compute device's backend (NCCL on GPU, gloo on CPU). ``stats`` counts the bytes this rank sends at both levels and,
apart, what crosses nodes (the rail's traffic).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Sequence

import torch
import torch.distributed as dist

from stem_megatron.host_tables.counters import Counted
from stem_megatron.host_tables.node import NodeLayout
from stem_megatron.host_tables.ownership import RowOwnership
from stem_megatron.host_tables.transfer import copy_to_device

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # host_tables.wire_dtype / host_tables.read_dtype


@dataclass
class Route:
    """One level of a step's rows on their way to the owners (the node's DP peers, or the rail): which rows this
    rank keeps and which it sends to each group rank, and where each kept, then received row adds up."""

    group: dist.ProcessGroup  # on the device's backend
    keep: torch.Tensor  # positions of the kept rows among the level's rows (on the device)
    send: torch.Tensor  # positions of the sent rows, by destination (on the device)
    send_counts: list[int]
    recv_counts: list[int]
    inverse: torch.Tensor  # [kept; received] rows -> position among ``ids`` (on the device)
    ids: torch.Tensor  # sorted ids this rank holds after the level (host)
    wire: torch.dtype
    # [kept; received] rows in the order of ``inverse`` (stable), and how many add up at each of ``ids`` (device):
    # a segmented sum in one order on every run, where an index_add on the GPU adds in the order its atomics land
    by_id: torch.Tensor
    adding: torch.Tensor

    def on(self, device: torch.device) -> Route:
        """The route with its positions on ``device`` (a plan made on the prefetch thread keeps them on the host
        until the training thread takes it: its copies then go, as every step's do, on that thread's stream)."""
        keep, send, inverse, by_id, adding = (copy_to_device(t, device) for t in (
            self.keep, self.send, self.inverse, self.by_id, self.adding))
        return replace(self, keep=keep, send=send, inverse=inverse, by_id=by_id, adding=adding)


class RowExchange(Counted):
    def __init__(self, ownership: RowOwnership, node: NodeLayout, device: torch.device, wire_dtype: str = "fp32"):
        """``node.local``: this rank's DP peers on its node (None: alone); ``node.rail``: the ranks of this peer
        class on every node, group rank = node index (None: one node); ``*_host``: their gloo twins."""
        self.own, self.device = ownership, device
        self.local, self.rail, self.local_host, self.rail_host = node.local, node.rail, node.local_host, node.rail_host
        self.local_plan, self.rail_plan = node.local_plan, node.rail_plan
        self.wire = DTYPES[wire_dtype]
        self.stats = self.new_stats()

    @staticmethod
    def new_stats() -> dict:
        return dict(bytes_sent=0, inter_node_sent=0, inter_node_received=0, exchange_s=0.0)

    def _count(self, group, sent: int, received: int) -> None:
        if group is not None and group in (self.local_plan, self.rail_plan):
            return  # the prefetch thread's ids, off the step's path: not this thread's counters
        self.stats["bytes_sent"] += sent
        if group in (self.rail, self.rail_host):
            self.stats["inter_node_sent"] += sent
            self.stats["inter_node_received"] += received

    # ---- gradients ----
    def plan(self, ids: torch.Tensor, ahead: bool = False) -> tuple[list[Route], torch.Tensor]:
        """How the rows of a step's gradients (one per sorted distinct id in ``ids``, on the host) reach their
        owners: the routes of both levels and the sorted ids this rank then holds, those it updates. A collective
        over the gloo twins of the node and rail groups, ids only; ``ahead``: over the planning groups instead
        (``NodeLayout.local_plan``, the prefetch thread's), not counted in this rank's exchange time, the routes'
        positions left on the host (``Route.on``)."""
        start, routes = time.perf_counter(), []
        local, rail = (self.local_plan, self.rail_plan) if ahead else (self.local_host, self.rail_host)
        levels = ((self.local, local, self.own.peer_of, self.own.peer, torch.float32),
                  (self.rail, rail, self.own.owner, self.own.node, self.wire))
        for group, host, dest_of, me, wire in levels:
            if group is None:
                continue
            dest = dest_of(ids)
            order = torch.argsort(dest, stable=True)
            mine = dest[order] == me
            keep, send = order[mine], order[~mine]
            counts = torch.bincount(dest[send], minlength=dist.get_world_size(host))
            received, (got,) = self._all_to_all(host, counts, ids[send], device=torch.device("cpu"))
            merged, inverse = torch.unique(torch.cat([ids[keep], got]), return_inverse=True)
            route = Route(group, keep, send, counts.tolist(), received.tolist(), inverse, merged, wire,
                          torch.argsort(inverse, stable=True), torch.bincount(inverse, minlength=merged.numel()))
            routes.append(route if ahead else route.on(self.device))
            ids = merged
        if not ahead:
            self.stats["exchange_s"] += time.perf_counter() - start
        return routes, ids

    def to_owners(self, routes: Sequence[Route], grads: torch.Tensor) -> torch.Tensor:
        """A layer's gradient rows (one per id the plan started from) summed over the DP group at the rows' owners,
        in fp32: the gradients of the plan's final ids. Rows cross nodes in the wire dtype."""
        start = time.perf_counter()
        for route in routes:
            out = grads.index_select(0, route.send).to(route.wire)
            got = out.new_empty((sum(route.recv_counts), grads.shape[1]))
            dist.all_to_all_single(got, out, route.recv_counts, route.send_counts, group=route.group)
            row = grads.shape[1] * out.element_size()
            self._count(route.group, sum(route.send_counts) * row, sum(route.recv_counts) * row)
            rows = torch.cat([grads.index_select(0, route.keep), got.float()]).index_select(0, route.by_id)
            grads = torch.segment_reduce(rows, "sum", lengths=route.adding, unsafe=True)  # one order on every run
        self.stats["exchange_s"] += time.perf_counter() - start
        return grads

    def from_owners(self, routes: Sequence[Route], rows: torch.Tensor) -> torch.Tensor:
        """``to_owners`` reversed: rows of the plan's final ids (this rank's, as the owner updated them) back to every
        rank that sent their gradients, level by level in the opposite order, in ``rows``' dtype. Returns the rows of
        the ids the plan started from (the rank's step ids), on the device."""
        start = time.perf_counter()
        for route in reversed(routes):
            back = rows.index_select(0, route.inverse)  # [kept; received], as they were summed
            kept = route.keep.numel()
            got = back.new_empty((sum(route.send_counts), rows.shape[1]))
            dist.all_to_all_single(got, back[kept:].contiguous(), route.send_counts, route.recv_counts,
                                   group=route.group)
            row = rows.shape[1] * rows.element_size()
            self._count(route.group, sum(route.recv_counts) * row, sum(route.send_counts) * row)
            rows = back.new_empty((kept + got.shape[0], rows.shape[1]))
            rows[route.keep] = back[:kept]
            rows[route.send] = got  # by destination, each one's rows in the order they were sent
        self.stats["exchange_s"] += time.perf_counter() - start
        return rows

    # ---- which rows changed elsewhere ----
    def updated_elsewhere(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids the peers of my class on other nodes updated this step (I updated ``ids``): rows my node's
        copy now holds stale. Ids only, 8 bytes a row, over the rail's gloo twin (no device work to wait for)."""
        if self.rail is None:
            return ids[:0]
        start = time.perf_counter()
        size = dist.get_world_size(self.rail_host)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        dist.all_gather(lengths, torch.tensor([ids.numel()]), group=self.rail_host)
        longest = int(max(n.item() for n in lengths))
        padded = torch.full((longest,), -1, dtype=torch.int64)
        padded[:ids.numel()] = ids
        gathered = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(gathered, padded, group=self.rail_host)
        others = torch.cat([g for n, g in enumerate(gathered) if n != self.own.node])
        self._count(self.rail_host, (longest + 1) * 8 * (size - 1), (longest + 1) * 8 * (size - 1))
        self.stats["exchange_s"] += time.perf_counter() - start
        return others[others >= 0]

    # ---- which rows the next step reads ----
    def read_anywhere(self, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Over token ids: True where any rank of the DP group reads the row (``ids``: what I read). A V-byte
        max over my node's peers, then over my rail, on the host (the groups' gloo twins: a mask through the
        device would wait there for the step's optimizer); counted as ring all-reduces."""
        mask = torch.zeros(vocab_size, dtype=torch.uint8)
        mask[ids] = 1
        for group in (self.local_host, self.rail_host):
            if group is not None:
                dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=group)
                n = dist.get_world_size(group)
                self._count(group, 2 * (n - 1) * vocab_size // n, 2 * (n - 1) * vocab_size // n)
        return mask.bool()

    # ---- fresh rows for the node's copy ----
    def node_needs(self, ids: torch.Tensor) -> torch.Tensor:
        """Sorted ids of my class that any DP peer of my node asks for (``ids``: what I ask for); ids only, over the
        node group's gloo twin."""
        ids = torch.unique(ids)
        if self.local is None:
            return ids
        dest = self.own.peer_of(ids)
        order = torch.argsort(dest, stable=True)
        ids, dest = ids[order], dest[order]
        keep = dest == self.own.peer
        counts = torch.bincount(dest[~keep], minlength=dist.get_world_size(self.local_host))
        _, (got,) = self._all_to_all(self.local_host, counts, ids[~keep], device=torch.device("cpu"))
        return torch.unique(torch.cat([ids[keep], got]))

    def pull(self, ids: torch.Tensor, tables: Sequence[torch.Tensor]) -> None:
        """Copy the owners' rows ``ids`` (sorted, of my class, none owned by my node) into ``tables``
        (this node's ``[V, cols]`` copies in position order, one per layer), serving the other nodes'
        requests for my rows from the same tables, in their dtype. Collective over the rail."""
        if self.rail is None:
            return
        start = time.perf_counter()
        dest = self.own.owner(ids)
        order = torch.argsort(dest, stable=True)
        ids, dest = ids[order], dest[order]
        counts = torch.bincount(dest, minlength=dist.get_world_size(self.rail))
        asked_counts, (asked,) = self._all_to_all(self.rail, counts, ids)
        at = self.own.position(asked.cpu())
        rows = torch.cat([t.index_select(0, at) for t in tables], dim=1)  # the owner's rows
        _, (got,) = self._all_to_all(self.rail, asked_counts, rows)
        got = got.cpu()
        cols = tables[0].shape[1]
        at = self.own.position(ids)
        for i, table in enumerate(tables):
            table[at] = got[:, i * cols:(i + 1) * cols]
        self.stats["exchange_s"] += time.perf_counter() - start

    # ---- the collective under all of the above ----
    def _all_to_all(self, group, counts: torch.Tensor, *tensors: torch.Tensor,
                    device: torch.device = None) -> tuple[torch.Tensor, list]:
        """Rows ``tensors[j][sum(counts[:i]) : sum(counts[:i+1])]`` go to group rank i, through ``device``
        (default: the compute device). Returns the counts received from each rank and the received rows of each
        tensor, ordered by source rank."""
        device = device or self.device
        counts = counts.to(device)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        send, recv = counts.tolist(), received.tolist()
        self._count(group, 8 * (len(send) - 1), 8 * (len(send) - 1))
        out = []
        for t in tensors:
            t = t.to(device).contiguous()
            got = t.new_empty((sum(recv), *t.shape[1:]))
            dist.all_to_all_single(got, t, recv, send, group=group)
            row = math.prod(t.shape[1:]) * t.element_size()
            self._count(group, sum(send) * row, sum(recv) * row)
            out.append(got)
        return received, out
