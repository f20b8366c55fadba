"""Host-resident STEM tables at decode time: one process, rows fetched per step for the unique ids only.

An export holds every ``U_l`` as a full V x d_ff matrix. ``ReadOnlyHostTables`` keeps them in host memory
(plain CPU tensors) and, for each forward, gathers only the rows of the step's distinct token ids
(``B_uniq x d_ff`` per STEM layer; one decode step of a batch of B sequences feeds B tokens) and hands
them to the compute device (``host_tables.transfer.HostToDevice``: on GPU the gathered rows go through a
pinned buffer and a side stream; on CPU there is nothing to copy), serving the hottest rows from an
optional device cache (``host_tables.hot_rows.HotRowCache``).

The STEM layers receive the rows through the training path's mechanism: the forward is wrapped in
``token_context.token_ids(tokens, V, prefetched)`` with the ``host_tables.transfer.PrefetchedRows`` of
``fetch``, and the layer's row source is the training-time ``host_tables.store.HostRowSource``
given this object as its store (the inference package builds that model), which reads the rows through
``rows`` under ``torch.no_grad`` (inference has no row gradients).
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

import torch

from stem_megatron.host_tables.hot_rows import HotRowCache
from stem_megatron.host_tables.transfer import HostToDevice, PrefetchedRows, fetch_rows

TABLE_NAME = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.U_l\.weight$")


def split_tables(weights: Mapping[str, torch.Tensor]) -> tuple[dict[int, torch.Tensor], dict[str, torch.Tensor]]:
    """``({global 1-based layer number: U_l}, the other weights)`` of an export's weights."""
    tables, rest = {}, {}
    for name, tensor in weights.items():
        match = TABLE_NAME.match(name)
        if match:
            tables[int(match.group(1)) + 1] = tensor
        else:
            rest[name] = tensor
    return tables, rest


class ReadOnlyHostTables:
    """The STEM tables of one model in host memory, serving ``U_l[uniq]`` per forward.

    ``tables``: ``{global 1-based layer number: V x d_ff tensor}``. ``cache_rows``: rows per table
    kept on ``device`` (the most frequent ids seen so far; 0 disables the cache). The tables never
    change at inference, so cached rows are only re-chosen (every ``refresh_every`` steps), never
    re-read. ``fetch_count`` counts the fetches (the forwards served), for the cache's refresh timing.
    """

    def __init__(self, tables: Mapping[int, torch.Tensor], device: Optional[torch.device] = None,
                 cache_rows: int = 0, refresh_every: int = 50):
        if not tables:
            raise ValueError("no STEM tables: host-resident rows need a STEM model (stem, stem_dagger, stem_gate)")
        shapes = {tuple(t.shape) for t in tables.values()}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise ValueError(f"STEM tables must all be V x d_ff matrices, got shapes {sorted(shapes)}")
        if refresh_every < 2:
            raise ValueError(f"refresh_every={refresh_every} must be >= 2 (HotRowCache re-chooses at step % n == 1)")
        self.layers = sorted(tables)
        self.vocab_size, self.d_ff = next(iter(shapes))
        self.device = torch.device(device or "cpu")
        self.tables = {layer: tables[layer].detach().to("cpu").contiguous() for layer in self.layers}
        self.cache = HotRowCache(cache_rows, self.vocab_size, self.device, refresh_every)
        self.h2d = HostToDevice(self.device)
        self.fetch_count = 0

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tables.values())

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of one table."""
        return self.d_ff * next(iter(self.tables.values())).element_size()

    def fetch(self, tokens: torch.Tensor) -> PrefetchedRows:
        """The rows a forward over ``tokens`` ([b, s]) needs: ``U_l[unique ids]`` of every STEM layer.

        Cached ids are read from the device cache, the others gathered from host memory and copied
        to the device (``transfer.fetch_rows``: pinned buffer + side stream on GPU, nothing to copy on CPU).
        """
        prefetched, hit = fetch_rows(tokens, self.vocab_size, self.tables, self.cache, self.h2d)
        hits = int(hit.sum())
        prefetched.fetched.stats.update(tokens=tokens.numel(), unique_tokens=prefetched.uniq.numel(),
                                        rows_from_host=prefetched.uniq.numel() - hits,  # per STEM layer
                                        rows_from_cache=hits,
                                        bytes_to_device=(prefetched.uniq.numel() - hits) * len(self.layers)
                                        * self.row_bytes)
        self.fetch_count += 1
        return prefetched

    def refresh_cache(self, step: int) -> None:
        """After forward ``step`` (1-based): re-choose the cached rows from the counts when due."""
        if self.cache.choose(step):
            self.cache.reload(self.tables, self.h2d)

    def rows(self, layer: int, prefetched: PrefetchedRows) -> torch.Tensor:
        """(forward, under ``torch.no_grad``) ``layer``'s fetched rows."""
        if torch.is_grad_enabled():
            raise RuntimeError("ReadOnlyHostTables serve inference only: run the model under torch.no_grad() "
                               "(training uses host_tables.store.HostTableStore, which keeps row gradients)")
        return prefetched.fetched.rows[layer]

