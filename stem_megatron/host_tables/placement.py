"""Where the STEM tables live, asked once: ``build_tables`` returns this stage's host tables (``HostTableStore``) or
``NoTables``, their absence (``host_tables.placement=device``, or a model without tables: dense, Hash-MoE), whose
verbs do what having no host tables means, so the code that takes either never asks which it holds."""

from __future__ import annotations

import contextlib
from typing import Iterator, Union

import torch
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from stem_megatron.config import RunConfig
from stem_megatron.host_tables.store import HostTableStore, StoreConfig
from stem_megatron.layer_plan import planned_layers
from stem_megatron.model.device_table import table_init_std
from stem_megatron.run_plan import tables_on_host


class NoTables:
    """No host tables: batches stream as they are, nothing to settle, count, export, load or checkpoint."""

    hosted = False  # a checkpoint has no ``stem/`` part (``checkpoint/host_tables.py``)
    layers: tuple[int, ...] = ()
    host_bytes = 0

    def row_source(self) -> None:
        """None: STEM layers, if any, hold their tables as parameters (``model.device_table``)."""
        return None

    def stream(self, batches: Iterator[dict], micro_batches: int, depth: int = 2, training: bool = True):
        return contextlib.nullcontext(batches)

    def settle(self) -> None:
        pass

    def owner_tables(self) -> dict[int, torch.Tensor]:
        return {}

    def load_tables(self, tables: dict[int, torch.Tensor]) -> None:
        if tables:
            raise ValueError(f"layers {sorted(tables)} have no host table: their tables are the model's parameters")

    def take_stats(self, stream=None) -> dict:
        return {}

    def sharded_state_dict(self, **kwargs) -> dict:
        """Nothing for a checkpoint to save (as the optimizer chain's tables member: ``FiniteChain.tables``)."""
        return {}


Tables = Union[HostTableStore, NoTables]


def build_tables(cfg: RunConfig, tconfig: TransformerConfig, device: torch.device, micro_batches: int) -> Tables:
    """The host tables of this pipeline stage's STEM layers (collective: every rank builds one) with
    ``host_tables.placement=host`` and a STEM variant, else ``NoTables``. ``micro_batches``: a step's, per DP rank."""
    if not tables_on_host(cfg):
        return NoTables()
    first = get_transformer_layer_offset(tconfig) + 1
    local = range(first, first + get_num_layers_to_build(tconfig))
    layers = [i + 1 for i in planned_layers(cfg.model.num_layers, cfg.stem) if i + 1 in local]
    t, m, h = cfg.train, cfg.model, cfg.host_tables
    return HostTableStore(StoreConfig(
        tuple(layers), m.vocab_size, m.ffn_hidden_size,
        table_init_std(tconfig, m.vocab_size, cfg.stem.table_init, cfg.stem.table_init_std), t.seed, host=h,
        betas=(t.adam_beta1, t.adam_beta2), eps=1e-8, weight_decay=t.weight_decay, compute_dtype=tconfig.params_dtype,
        micro_batch_tokens=t.micro_batch_size * m.seq_length, micro_batches=micro_batches), device)
