"""Total and active parameter counts of a preset + variant, from a model built on the meta device.

"Active" excludes the STEM tables ``U_l``: a token reads one row of each (d_ff values), which the
paper does not count (Table 3); for Hash-MoE it excludes the experts a token does not run (all but
one per MoE layer). Nothing is allocated, so 1B/350M presets count in a second.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer

from stem_megatron.config import ModelConfig, ParallelConfig, STEMConfig
from stem_megatron.model.gpt import build_gpt, transformer_config
from stem_megatron.model.device_table import DeviceRowTable


@dataclass
class ParamCount:
    total: int
    tables: int
    inactive_experts: int = 0  # Hash-MoE: a token runs 1 of num_experts experts per MoE layer

    @property
    def active(self) -> int:
        return self.total - self.tables - self.inactive_experts


def count_parameters(model: ModelConfig, stem: STEMConfig) -> ParamCount:
    """Counts for one process (TP=PP=1); needs megatron's parallel state initialised (world of 1)."""
    config = transformer_config(model, ParallelConfig(), on_gpu=False, use_cpu_initialization=True, stem=stem)
    with torch.device("meta"):
        gpt = build_gpt(model, stem, config, pre_process=True, post_process=True)
    total = sum(p.numel() for p in gpt.parameters())
    tables = sum(m.weight.numel() for m in gpt.modules() if isinstance(m, DeviceRowTable))
    experts = sum(p.numel() for m in gpt.modules() if isinstance(m, MoELayer) for p in m.experts.parameters())
    inactive_experts = experts * (stem.num_experts - 1) // stem.num_experts if experts else 0
    return ParamCount(total=total, tables=tables, inactive_experts=inactive_experts)
