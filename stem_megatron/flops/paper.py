"""The paper's own counts, in its unit (multiply-accumulates, MACs; x2 for FLOPs).

**Table 1**, per FFN layer: prefill / training ``B(3 d_ff d L + d_ff L)`` (FFN) vs
``B(2 d_ff d L + d_ff L)`` (STEM), saving ``B d d_ff L``; decoding parameter loading ``3 d d_ff`` vs
``2 d d_ff``; STEM's row traffic ``uniq(BL) d_ff`` / ``B_uniq d_ff`` (symbolic; only an upper bound is
numeric). **§3.1**: the saving fraction ``d_ff / (4d + 2L + 3 d_ff)`` of one decoder layer (attention
counted as multi-head, ``4 L d^2 + 2 L^2 d`` MACs; no LM head).
"""

from __future__ import annotations

from fractions import Fraction


def table1(d: int, d_ff: int, seq_length: int, batch: int = 1, vocab_size: int | None = None) -> dict:
    """Paper Table 1 for one decoder FFN layer (SwiGLU, no biases, elementwise ops as d_ff L)."""
    B, L = batch, seq_length
    ffn = B * (3 * d_ff * d * L + d_ff * L)
    stem = B * (2 * d_ff * d * L + d_ff * L)
    rows_bound = min(B * L, vocab_size) if vocab_size else B * L
    decode_rows_bound = min(B, vocab_size) if vocab_size else B
    return {
        "unit": "multiply-accumulates (x2 for FLOPs as FlopCounterMode counts them)",
        "prefill_training_flops": {"ffn": ffn, "stem": stem, "saving": ffn - stem,
                                   "formula": {"ffn": "B(3 d_ff d L + d_ff L)", "stem": "B(2 d_ff d L + d_ff L)",
                                               "saving": "B d d_ff L"}},
        "decoding_parameter_loading": {"ffn": 3 * d * d_ff, "stem": 2 * d * d_ff, "saving": d * d_ff,
                                       "formula": {"ffn": "3 d d_ff", "stem": "2 d d_ff", "saving": "d d_ff"}},
        "communication": {
            "prefill_training": {"ffn": 0, "stem": "uniq(BL) d_ff", "stem_upper_bound": rows_bound * d_ff,
                                 "note": "values of U_l rows fetched per STEM layer; uniq(BL) <= min(BL, V). "
                                         "Doubles in training: the row gradients go back to the host"},
            "decoding": {"ffn": 0, "stem": "B_uniq d_ff", "stem_upper_bound": decode_rows_bound * d_ff,
                         "note": "values per STEM layer per decode step; B_uniq <= min(B, V)"},
        },
    }


def paper_saving_fraction(d: int, d_ff: int, seq_length: int) -> Fraction:
    """§3.1: d_ff / (4d + 2L + 3 d_ff), one decoder layer, multi-head attention, every FFN replaced."""
    return Fraction(d_ff, 4 * d + 2 * seq_length + 3 * d_ff)


def paper_layer_train_flops(d: int, d_ff: int, seq_length: int, batch: int = 1) -> dict:
    """§3.1 per-layer counts B(4Ld^2 + 2L^2 d + 3Ld d_ff) and B(4Ld^2 + 2L^2 d + 2Ld d_ff) (MACs)."""
    B, L = batch, seq_length
    attn = B * (4 * L * d * d + 2 * L * L * d)
    return {"base": attn + B * 3 * L * d * d_ff, "stem": attn + B * 2 * L * d * d_ff}
