"""The host memory a composed run's tables take (``recipes.compose_run`` composes it)."""

from __future__ import annotations

from stem_megatron.config import RunConfig
from stem_megatron.layer_plan import planned_layers

FP32_BYTES = 4
HOST_TENSORS = 3  # a table and its two Adam moments


def host_table_bytes(cfg: RunConfig) -> int:
    """Host memory (/dev/shm) the run's STEM tables take on a node holding every layer, roughly: V x d_ff fp32
    for the table and each Adam moment, per STEM layer; 0 when the tables are not in host memory."""
    from stem_megatron.model.stem_mlp import STEM_VARIANTS

    if cfg.stem.placement != "host" or cfg.stem.variant not in STEM_VARIANTS:
        return 0
    m = cfg.model
    return len(planned_layers(m.num_layers, cfg.stem)) * m.vocab_size * m.ffn_hidden_size * HOST_TENSORS * FP32_BYTES
