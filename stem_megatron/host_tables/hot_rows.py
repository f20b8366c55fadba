"""The hot-row cache: device copies of the most frequent rows of each STEM table, read instead of the host's (paper
§3.1.1; the host tier's and inference's read-only tables')."""

from __future__ import annotations

import torch

from stem_megatron.host_tables.transfer import HostToDevice


class HotRowCache:
    """Per-layer device copies of the ``capacity`` most frequent rows; a capacity of 0 disables it.

    Token frequencies are Zipfian, so a few thousand rows cover most lookups. Rows are chosen from the token counts
    seen so far, re-chosen every ``refresh_every`` steps, and re-read after every step (the hottest rows are touched,
    so updated, by nearly every step), so a cached row is never stale. They are re-read as fetched rows are, through a
    fetch's pinned staging on the side stream, where the fetches that read them run: no event between streams. A
    working set replaces it (``config.validate``): it holds the hot rows with their state."""

    def __init__(self, capacity: int, vocab_size: int, device: torch.device, refresh_every: int = 50):
        self.capacity = min(capacity, vocab_size)
        self.device = device
        self.refresh_every = refresh_every
        self.counts = torch.zeros(vocab_size, dtype=torch.int64)
        self.ids = torch.empty(0, dtype=torch.int64)
        self.rows: dict[int, torch.Tensor] = {}

    def observe(self, uniq: torch.Tensor, counts: torch.Tensor) -> None:
        self.counts.index_add_(0, uniq, counts)

    def split(self, uniq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hit mask over ``uniq``, positions of the hits in the cache)."""
        if self.ids.numel() == 0:
            return torch.zeros_like(uniq, dtype=torch.bool), torch.empty(0, dtype=torch.int64)
        pos = torch.searchsorted(self.ids, uniq).clamp_(max=self.ids.numel() - 1)
        hit = self.ids[pos] == uniq
        return hit, pos[hit]

    def choose(self, step: int) -> bool:
        """Re-choose the held ids (``ids``) after step ``step`` when due (every ``refresh_every`` steps); True if it
        did."""
        if not self.capacity or (step % self.refresh_every != 1 and self.ids.numel()):
            return False
        self.ids = torch.sort(torch.topk(self.counts, self.capacity).indices).values
        return True

    def reload(self, tables: dict[int, torch.Tensor], h2d: HostToDevice, at=None) -> None:
        """Copy the held rows from the (current) host tables through ``h2d`` (a layer a transfer, in the precision
        rows travel in); ``at`` maps ids to table rows (default: row = id)."""
        if not self.ids.numel():
            return
        rows_at = self.ids if at is None else at(self.ids)
        for layer, table in tables.items():
            with h2d.transfer() as send:
                self.rows[layer] = send.gather(table, rows_at)
