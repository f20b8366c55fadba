"""The rows a rank's step reads at DP > 1 with a working set, received from their owners (issue 31, design 3.).

A row is updated once, by its owner (``ownership.RowOwnership``), in the owner's working set, with every rank's
gradients (``RowExchange.to_owners``). The other ranks that read it next need the updated row before their next
forward: right after the owners' update and the admission of the next step's rows, each owner sends its rows of
the next step back along that step's routes reversed (``RowExchange.from_owners``: over the rail, then to the
node's DP peers), in the dtype rows travel in, every layer at once, on the training thread where every rank issues
the step's other collectives. A rank keeps the rows of its next step's distinct ids, which the forward reads by
position among them (``WorkingSet.fetch(by_position=True)``). Readers hold no optimizer state: a row changes only
at its owner. Bytes: a rank receives its step's distinct rows once (U x cols a layer in the travel dtype: 0.53 GB a
step over 1B STEM-1/3's 5 layers at TP 1 in bf16), where the host path pulls them across nodes into host memory,
gathers them there and copies them to the device.
"""

from __future__ import annotations

import time

import torch

from stem_megatron.host_tables.exchange import Route, RowExchange
from stem_megatron.host_tables.working_set import WorkingSet


class StepRows:
    """Per STEM layer, the rows of the step about to run, in the order of its sorted distinct ids."""

    def __init__(self, layers: list[int], exchange: RowExchange, resident: WorkingSet):
        self.layers, self.exchange, self.resident = layers, exchange, resident
        self.rows: dict[int, torch.Tensor] = {}
        self.stats = self.new_stats()

    @staticmethod
    def new_stats() -> dict:
        """Rows received a step (each layer counted) and the training thread's seconds in ``receive``."""
        return dict(rows_received=0, receive_s=0.0)

    def receive(self, routes: list[Route], owned: torch.Tensor) -> None:
        """(training thread) The rows of the step ``routes`` plan, from their owners; ``owned``: this rank's rows of
        it, resident in its working set and updated. Collective over the exchange's groups (on every rank; a stage
        without STEM layers has none to send on any of its ranks)."""
        if not self.layers:
            return
        start = time.perf_counter()
        slots = self.resident.slot_of[owned].to(self.resident.device, non_blocking=True)
        mine = [self.resident.rows(layer, slots) for layer in self.layers]
        every = self.exchange.from_owners(routes, mine[0] if len(mine) == 1 else torch.cat(mine, dim=1))
        self.rows = dict(zip(self.layers, every.split(self.resident.cols, dim=1)))
        self.stats["rows_received"] += every.shape[0] * len(self.layers)
        self.stats["receive_s"] += time.perf_counter() - start

    def read(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """A micro-batch's rows of ``layer`` by position among the step's ids, as an fp32 tensor (the layer's leaf)."""
        rows = self.rows.get(layer)
        if rows is None:
            raise RuntimeError("a training step reads rows its owners did not send: fetch a step's rows after "
                               "store.admit or store.step announced it (RowPrefetcher and with_rows do)")
        return rows.index_select(0, positions).float()

    def drop(self) -> None:
        """Forget the received rows (the host record was loaded anew)."""
        self.rows = {}
