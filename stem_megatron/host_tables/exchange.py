"""STEM row traffic between a node's DP peers and between nodes: gradients to owners, fresh rows back.

Everything sent is ids and rows of distinct ids, never tokens, so the bytes grow with distinct ids,
not batch tokens, and no expert all-to-all appears. Two levels (``ownership.RowOwnership``):
- in a node, each row goes to the DP peer of its class, which sums duplicates: a row leaves a node once;
- between nodes, the peers of one class form a "rail" (one rank per node, ordered by node) and send
  each row to its owner node.
Collectives run on the compute device's backend (NCCL on GPU, gloo on CPU). ``stats`` counts the bytes this
rank sends at both levels and, apart, what crosses nodes (the rail's traffic).
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import torch
import torch.distributed as dist

from stem_megatron.host_tables.ownership import RowOwnership

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # stem.wire_dtype / stem.read_dtype


class RowExchange:
    def __init__(self, ownership: RowOwnership, local_group, rail_group, device: torch.device,
                 wire_dtype: str = "fp32"):
        """``local_group``: this rank's DP peers on its node (None: alone); ``rail_group``: the ranks of
        this peer class on every node, group rank = node index (None: one node)."""
        self.own, self.local, self.rail, self.device = ownership, local_group, rail_group, device
        self.wire = DTYPES[wire_dtype]
        self.stats = self.new_stats()

    @staticmethod
    def new_stats() -> dict:
        return dict(bytes_sent=0, inter_node_sent=0, inter_node_received=0, exchange_s=0.0)

    def _count(self, group, sent: int, received: int) -> None:
        self.stats["bytes_sent"] += sent
        if group is self.rail:
            self.stats["inter_node_sent"] += sent
            self.stats["inter_node_received"] += received

    # ---- gradients ----
    def to_owners(self, ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sorted ids this rank updates, their gradients summed over the DP group), from this rank's
        compact gradient (sorted unique ``ids``). Rows cross nodes in the wire dtype and are summed in fp32."""
        start = time.perf_counter()
        if self.local is not None:
            ids, grads = self._route(ids, grads, self.own.peer_of(ids), self.local, self.own.peer, torch.float32)
        if self.rail is not None:
            ids, grads = self._route(ids, grads, self.own.owner(ids), self.rail, self.own.node, self.wire)
        self.stats["exchange_s"] += time.perf_counter() - start
        return ids, grads

    def _route(self, ids, grads, dest, group, me: int, wire: torch.dtype):
        """Send rows to ``dest`` (group ranks), keep mine in fp32, merge what arrives by id."""
        order = torch.argsort(dest, stable=True)
        ids, grads, dest = ids[order], grads[order], dest[order]
        keep = dest == me
        counts = torch.bincount(dest[~keep], minlength=dist.get_world_size(group))
        _, (got_ids, got_rows) = self._all_to_all(group, counts, ids[~keep], grads[~keep].to(wire))
        merged, inverse = torch.unique(torch.cat([ids[keep], got_ids]), return_inverse=True)
        summed = torch.zeros(merged.numel(), grads.shape[1], dtype=torch.float32, device=grads.device)
        return merged, summed.index_add_(0, inverse, torch.cat([grads[keep], got_rows.float()]))

    # ---- which rows changed elsewhere ----
    def updated_elsewhere(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids the peers of my class on other nodes updated this step (I updated ``ids``): rows my node's
        copy now holds stale. Ids only: 8 bytes a row."""
        if self.rail is None:
            return ids[:0]
        start = time.perf_counter()
        size = dist.get_world_size(self.rail)
        lengths = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(size)]
        dist.all_gather(lengths, torch.tensor([ids.numel()], device=self.device), group=self.rail)
        longest = int(max(n.item() for n in lengths))
        padded = torch.full((longest,), -1, dtype=torch.int64, device=self.device)
        padded[:ids.numel()] = ids.to(self.device)
        gathered = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(gathered, padded, group=self.rail)
        others = torch.cat([g for n, g in enumerate(gathered) if n != self.own.node])
        self._count(self.rail, (longest + 1) * 8 * (size - 1), (longest + 1) * 8 * (size - 1))
        self.stats["exchange_s"] += time.perf_counter() - start
        return others[others >= 0].cpu()

    # ---- which rows the next step reads ----
    def read_anywhere(self, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Over token ids: True where any rank of the DP group reads the row (``ids``: what I read). A V-byte
        max over my node's peers, then over my rail; counted as ring all-reduces."""
        mask = torch.zeros(vocab_size, dtype=torch.uint8, device=self.device)
        mask[ids.to(self.device)] = 1
        for group in (self.local, self.rail):
            if group is not None:
                dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=group)
                n = dist.get_world_size(group)
                self._count(group, 2 * (n - 1) * vocab_size // n, 2 * (n - 1) * vocab_size // n)
        return mask.cpu().bool()

    # ---- fresh rows for the node's copy ----
    def node_needs(self, ids: torch.Tensor) -> torch.Tensor:
        """Sorted ids of my class that any DP peer of my node asks for (``ids``: what I ask for)."""
        ids = torch.unique(ids)
        if self.local is None:
            return ids
        dest = self.own.peer_of(ids)
        order = torch.argsort(dest, stable=True)
        ids, dest = ids[order], dest[order]
        keep = dest == self.own.peer
        counts = torch.bincount(dest[~keep], minlength=dist.get_world_size(self.local))
        _, (got,) = self._all_to_all(self.local, counts, ids[~keep])
        return torch.unique(torch.cat([ids[keep], got.cpu()]))

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
    def _all_to_all(self, group, counts: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Rows ``tensors[j][sum(counts[:i]) : sum(counts[:i+1])]`` go to group rank i. Returns the counts
        received from each rank and the received rows of each tensor, ordered by source rank."""
        counts = counts.to(self.device)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        send, recv = counts.tolist(), received.tolist()
        self._count(group, 8 * (len(send) - 1), 8 * (len(send) - 1))
        out = []
        for t in tensors:
            t = t.to(self.device).contiguous()
            got = t.new_empty((sum(recv), *t.shape[1:]))
            dist.all_to_all_single(got, t, recv, send, group=group)
            row = math.prod(t.shape[1:]) * t.element_size()
            self._count(group, sum(send) * row, sum(recv) * row)
            out.append(got)
        return received, out
