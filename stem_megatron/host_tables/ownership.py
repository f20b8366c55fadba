"""Which node owns each STEM table row, and which of its ranks updates it.

Rows are owned by node through a fixed permutation of the vocabulary, ``pos(t) = a * t mod V`` with
``a`` near the golden ratio of V: node n of N owns the positions ``[n V / N, (n+1) V / N)``. Token
frequencies fall with the id in BPE vocabularies, so ranges of raw ids would give node 0 the hot rows;
the multiplicative permutation spreads consecutive ids evenly over the ranges. Host tables are stored in
position order, and the permutation does not depend on N, so a node's rows (its master rows and
moments) are one contiguous block for any node count, and checkpoints reshard to another node count by
range.

Inside the owner node, the row at local position ``i = pos - n V / N`` is updated by the node's
DP peer ``i mod k`` (k DP peers per node); that peer is also the one that forwards the row's gradients
from its own node and pulls the row for it (``exchange.py``), so every row has one path through a node.
"""

from __future__ import annotations

import math

import torch


def multiplier(vocab_size: int) -> int:
    """The permutation's multiplier: the integer nearest V (sqrt(5) - 1) / 2 that is coprime with V."""
    a = max(1, round(vocab_size * (math.sqrt(5) - 1) / 2))
    while math.gcd(a, vocab_size) != 1:
        a += 1
    return a


class RowOwnership:
    """Row placement over ``nodes`` nodes of ``peers`` DP ranks each, seen from (``node``, ``peer``)."""

    def __init__(self, vocab_size: int, nodes: int, node: int, peers: int, peer: int):
        self.vocab_size, self.nodes, self.node, self.peers, self.peer = vocab_size, nodes, node, peers, peer
        self.a = multiplier(vocab_size)
        self.lo, self.hi = self.range_of(node)

    def range_of(self, node: int) -> tuple[int, int]:
        """Positions (permuted order) of ``node``'s rows."""
        return node * self.vocab_size // self.nodes, (node + 1) * self.vocab_size // self.nodes

    @property
    def owned_rows(self) -> int:
        return self.hi - self.lo

    def position(self, ids: torch.Tensor) -> torch.Tensor:
        return ids * self.a % self.vocab_size

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        """Owner node of each id: the n with n V / N <= pos < (n+1) V / N."""
        return ((self.position(ids) + 1) * self.nodes - 1) // self.vocab_size

    def peer_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The DP peer (index on a node) that forwards, updates and pulls each id."""
        pos = self.position(ids)
        lo = self.owner(ids) * self.vocab_size // self.nodes
        return (pos - lo) % self.peers

    def ids_at(self, positions: torch.Tensor) -> torch.Tensor:
        return positions * pow(self.a, -1, self.vocab_size) % self.vocab_size

    def local(self, ids: torch.Tensor) -> torch.Tensor:
        """Row of each id (owned by this node) in the node's block of owned rows."""
        return self.position(ids) - self.lo

    def my_local(self) -> torch.Tensor:
        """Rows of the node's block that this rank updates (its peer class), ascending."""
        return torch.arange(self.peer, self.owned_rows, self.peers, dtype=torch.int64)

    def my_rows(self) -> torch.Tensor:
        """Sorted ids this rank updates."""
        return torch.sort(self.ids_at(self.lo + self.my_local())).values
