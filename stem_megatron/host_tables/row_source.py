"""``HostRowSource``: the row source of a STEM layer whose ``U_l`` lives in the host store.

It holds no parameters. It takes the rows the prefetcher fetched for this micro-batch (unique ids x this TP
rank's columns) and makes them a leaf tensor the store keeps. ``compact`` hands the STEM layer that leaf with each
token's position in it and the order the prefetcher sorted the tokens in, for ``model.stem_rows.silu_times_rows``;
``forward`` expands the rows to tokens with the inverse index (the variants that add to or gate with the rows).
Either way backward adds into the compact leaf (in fp32), so only touched rows ever carry a gradient.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from stem_megatron.host_tables.store import HostTableStore
from stem_megatron.host_tables.transfer import PrefetchedRows
from stem_megatron.model.stem_rows import RowOrder
from stem_megatron.model.token_context import MicroBatchTokens


class HostRowSource(MegatronModule):
    def __init__(self, config: TransformerConfig, vocab_size: int, store: HostTableStore):
        super().__init__(config=config)
        if vocab_size != store.vocab_size:
            raise ValueError(f"STEM layer vocab_size {vocab_size} != host store vocab_size {store.vocab_size}")
        self.store = store
        self.layer_number: int | None = None

    def set_layer_number(self, layer_number: int) -> None:
        if layer_number not in self.store.layers:
            raise ValueError(f"layer {layer_number} has no table in the host store (has {self.store.layers})")
        self.layer_number = layer_number

    def compact(self, tokens: MicroBatchTokens) -> tuple[torch.Tensor, torch.Tensor, Optional[RowOrder]]:
        """(the rows fetched for ``tokens``, ``[u, d_ff/tp]`` fp32; each token's row, ``[s, b]``; the tokens'
        order by row, or None where the fetch computed none)."""
        prefetched, rows = self._rows(tokens)
        return rows, prefetched.inverse.t(), prefetched.order

    def forward(self, tokens: MicroBatchTokens) -> torch.Tensor:
        """The rows fetched for ``tokens`` as [s, b, d_ff/tp] (``tokens.rows``: ids deduplicated, rows on
        their way to the device)."""
        prefetched, rows = self._rows(tokens)
        # Gather in fp32, then cast to the model's dtype (bf16 on GPU): the backward of the gather adds the
        # gradients of a token's repeats in fp32 into the fp32 compact leaf (gathering bf16 rows would
        # add them in bf16)
        return F.embedding(prefetched.inverse.t(), rows).to(self.config.params_dtype)

    def _rows(self, tokens: MicroBatchTokens) -> tuple[PrefetchedRows, torch.Tensor]:
        """The micro-batch's fetched rows, waited for; in training a leaf registered with the store."""
        prefetched = tokens.rows
        if prefetched is None:
            raise RuntimeError("a host-resident STEM layer ran without fetched rows: wrap the data iterator in "
                               "stem_megatron.host_tables.prefetch.RowPrefetcher (training) or pass the rows of "
                               "ReadOnlyHostTables.fetch to token_ids (inference)")
        prefetched.wait()
        rows = prefetched.fetched.rows.get(self.layer_number)
        if rows is None:  # training with a working set: gathered by slot here, on this stream, after the update
            rows = self.store.read_rows(self.layer_number, prefetched.slots)
        if torch.is_grad_enabled():
            rows = rows.detach().requires_grad_()
            self.store.register(self.layer_number, prefetched, rows)
        return prefetched, rows
