"""Exact matmul FLOPs of the whole model per batch, in FLOPs (2 per MAC, the convention of
``torch.utils.flop_counter.FlopCounterMode``), forward and training = 3 x forward.

Counted: GQA-aware q/k/v/o projections, attention scores and values (``2 L^2 h d_head`` each, the full
``L x L`` product: causal masking is *not* halved, as megatron's local attention computes it), the FFN
per layer plan and variant, the LM head ``2 L d V``. Elementwise ops, norms, RoPE, softmax, biases and
the table lookup are not matmuls and are not counted. ``tests/test_flops.py`` checks equality against
FlopCounterMode on a real megatron GPTModel.
"""

from __future__ import annotations

from fractions import Fraction

from stem_megatron.flops.arch import Arch
from stem_megatron.flops.variants import DENSE, FFN_MATMULS, Variant


def forward_flops(arch: Arch, seq_length: int, variant: Variant = DENSE, batch: int = 1) -> dict:
    """Forward matmul FLOPs of the whole model for ``batch`` sequences of ``seq_length`` tokens.

    Per layer: q/k/v ``2 L d (h + 2 g) d_head``, o ``2 L h d_head d``, attention scores and values
    ``2 L^2 h d_head`` each (full L x L, causal not halved), FFN ``2 L d d_ff`` per matmul (3 dense /
    STEM† / Hash-MoE top-1 expert, 2 STEM and gate-proj ablation); plus the LM head ``2 L d V``.
    """
    L, d = seq_length, arch.hidden_size
    n_layers = arch.num_layers
    replaced = set(variant.replaced(n_layers))
    attn_proj = 2 * L * d * (arch.q_dim + 2 * arch.kv_dim) + 2 * L * arch.q_dim * d
    attn_core = 2 * (2 * L * L * arch.q_dim)  # scores Q K^T + values P V, every head
    ffn_dense = FFN_MATMULS["dense"] * 2 * L * d * arch.ffn_hidden_size
    if variant.variant == "hash_moe":
        ffn_replaced = FFN_MATMULS["hash_moe"] * 2 * L * d * variant.expert_width(arch)
    else:
        ffn_replaced = FFN_MATMULS[variant.variant] * 2 * L * d * arch.ffn_hidden_size
    ffn = sum(ffn_replaced if i in replaced else ffn_dense for i in range(n_layers))
    out = {
        "attention_projections": batch * n_layers * attn_proj,
        "attention_core": batch * n_layers * attn_core,
        "ffn": batch * ffn,
        "lm_head": batch * 2 * L * d * arch.vocab_size,
    }
    out["total"] = sum(out.values())
    return out


def training_flops(arch: Arch, seq_length: int, variant: Variant = DENSE, batch: int = 1) -> dict:
    """Forward + backward = 3 x forward: every matmul's backward computes grad-input and grad-weight
    (attention: grad of both operands), each as many FLOPs as the forward matmul."""
    return {k: 3 * v for k, v in forward_flops(arch, seq_length, variant, batch).items()}


def exact_saving_fraction(arch: Arch, seq_length: int, variant: Variant) -> Fraction:
    """(dense - variant) / dense whole-model matmul FLOPs (same for forward and training)."""
    dense = forward_flops(arch, seq_length, DENSE)["total"]
    return Fraction(dense - forward_flops(arch, seq_length, variant)["total"], dense)


def exact_layer_saving_fraction(arch: Arch, seq_length: int) -> Fraction:
    """One decoder layer with GQA, no LM head: d d_ff / (d(q + 2kv) + q d + 2 L q + 3 d d_ff) — the §3.1
    formula with the model's real q/k/v widths (equal to it when kv = q = d)."""
    d, d_ff, L = arch.hidden_size, arch.ffn_hidden_size, seq_length
    q, kv = arch.q_dim, arch.kv_dim
    return Fraction(d * d_ff, d * (q + 2 * kv) + q * d + 2 * L * q + 3 * d * d_ff)
