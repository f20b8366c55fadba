"""Parameter counts, total and active: analytic from the shapes (no megatron needed), and of the
megatron-core model this repo builds (``count_parameters``, built on the meta device).

"Active" excludes the STEM tables ``U_l``: a token reads one row of each (d_ff values), which the
paper does not count (Table 3); for Hash-MoE it excludes the experts a token does not run (all but
one per MoE layer). Nothing is allocated, so 1B/350M presets count in a second. torch, megatron and
``stem_megatron.config`` are imported only by the megatron count, so ``stem-flops`` starts without them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from stem_megatron.flops.arch import DEFAULT_SEQ_LENGTH, Arch, FlopsError
from stem_megatron.flops.variants import DENSE, FFN_MATMULS, Variant, to_hash_moe_config, to_stem_config

if TYPE_CHECKING:
    from stem_megatron.config import HashMoEConfig, ModelConfig, STEMConfig


@dataclass
class ParamCount:
    """Parameters of one built model; ``active`` is what a token uses (see the module docstring)."""

    total: int
    tables: int
    inactive_experts: int = 0  # Hash-MoE: a token runs 1 of num_experts experts per MoE layer

    @property
    def active(self) -> int:
        return self.total - self.tables - self.inactive_experts


def analytic_parameters(arch: Arch, variant: Variant = DENSE, *, tied: bool | None = None,
                        qkv_bias: bool | None = None) -> dict:
    """Total / tables / active parameters from the shapes (RMSNorm weights, no linear biases except
    Qwen-style q/k/v biases). ``tied``/``qkv_bias`` default to the architecture's own; pass False to
    match the model this repo builds (untied, no biases). "Active" excludes the STEM tables (a token
    reads one d_ff row per table) and, for Hash-MoE, the experts a token does not run."""
    tied = arch.tie_word_embeddings if tied is None else tied
    qkv_bias = arch.qkv_bias if qkv_bias is None else qkv_bias
    d, d_ff, V = arch.hidden_size, arch.ffn_hidden_size, arch.vocab_size
    attn = d * (arch.q_dim + 2 * arch.kv_dim) + arch.q_dim * d + (arch.q_dim + 2 * arch.kv_dim) * qkv_bias
    norms = 2 * d
    replaced = set(variant.replaced(arch.num_layers))
    tables = experts = 0
    ffn = 0
    for i in range(arch.num_layers):
        if i not in replaced:
            ffn += 3 * d * d_ff
        elif variant.variant == "hash_moe":
            e = variant.num_experts * 3 * d * variant.expert_width(arch)
            ffn += e
            experts += e
        else:
            ffn += FFN_MATMULS[variant.variant] * d * d_ff
            tables += V * d_ff
    total = V * d * (1 if tied else 2) + arch.num_layers * (attn + norms) + ffn + tables + d
    inactive = experts * (variant.num_experts - 1) // variant.num_experts if experts else 0
    return {"total": total, "tables": tables, "inactive_experts": inactive, "active": total - tables - inactive,
            "tied_embeddings": tied, "qkv_bias": qkv_bias}


def to_model_config(arch: Arch, seq_length: int | None = None) -> ModelConfig:
    """The repo's ModelConfig for ``arch`` (megatron builds d_head = d / heads, untied, no biases)."""
    from stem_megatron.config import ModelConfig

    if arch.head_dim * arch.num_attention_heads != arch.hidden_size:
        raise FlopsError(f"{arch.name}: head_dim={arch.head_dim} x heads != hidden_size; this repo's megatron "
                         f"model uses d_head = hidden_size / heads, so it cannot build this shape")
    return ModelConfig(name=arch.name, num_layers=arch.num_layers, hidden_size=arch.hidden_size,
                       ffn_hidden_size=arch.ffn_hidden_size, num_attention_heads=arch.num_attention_heads,
                       num_query_groups=arch.num_kv_heads, vocab_size=arch.vocab_size,
                       seq_length=seq_length or arch.seq_length or DEFAULT_SEQ_LENGTH)


def count_parameters(model: ModelConfig, stem: STEMConfig, hash_moe: HashMoEConfig | None = None) -> ParamCount:
    """Counts for one process (TP=PP=1); needs megatron's parallel state initialised (world of 1). ``hash_moe``: the
    experts of ``stem.variant=hash_moe`` (None: its defaults)."""
    import torch
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from stem_megatron.config import ParallelConfig
    from stem_megatron.model.device_table import DeviceRowTable
    from stem_megatron.model.gpt import build_gpt, transformer_config

    config = transformer_config(model, ParallelConfig(), on_gpu=False, use_cpu_initialization=True, stem=stem,
                                hash_moe=hash_moe)
    with torch.device("meta"):
        gpt = build_gpt(model, stem, config, pre_process=True, post_process=True, hash_moe=hash_moe)
    total = sum(p.numel() for p in gpt.parameters())
    tables = sum(m.weight.numel() for m in gpt.modules() if isinstance(m, DeviceRowTable))
    experts = sum(p.numel() for m in gpt.modules() if isinstance(m, MoELayer) for p in m.experts.parameters())
    inactive_experts = experts * (config.num_moe_experts - 1) // config.num_moe_experts if experts else 0
    return ParamCount(total=total, tables=tables, inactive_experts=inactive_experts)


def megatron_parameters(pairs: Iterable[tuple[Arch, Variant]], seed: int = 0) -> list[dict]:
    """``count_parameters`` (megatron GPTModel on the meta device) for each (arch, variant). Starts
    megatron's parallel state as a world of one if it is not running, and tears it down after."""
    from megatron.core import parallel_state

    from stem_megatron import parallel

    pairs = list(pairs)
    jobs = []
    for arch, variant in pairs:
        if variant.ratio == "all" and variant.layers is None and variant.variant != "dense":
            variant = replace(variant, layers=tuple(range(arch.num_layers)))
        jobs.append((to_model_config(arch), to_stem_config(variant), to_hash_moe_config(variant)))
    started = not parallel_state.model_parallel_is_initialized()
    if started:
        parallel.single_process_env()
        parallel.initialize(1, 1, seed)
    try:
        out = []
        for model, stem, hash_moe in jobs:
            c = count_parameters(model, stem, hash_moe)
            out.append({"total": c.total, "tables": c.tables, "inactive_experts": c.inactive_experts,
                        "active": c.active})
        return out
    finally:
        if started:
            parallel.destroy()
