"""FLOP, parameter and training-ROI estimator for STEM vs dense SwiGLU transformers (``stem-flops``).

Four views of the same question, "what does replacing ``W_u`` by ``U_l[t]`` save?":

1. **Table 1** (paper): per FFN layer, in the paper's unit (multiply-accumulates, MACs). Prefill /
   training ``B(3 d_ff d L + d_ff L)`` (FFN) vs ``B(2 d_ff d L + d_ff L)`` (STEM), saving
   ``B d d_ff L``; decoding parameter loading ``3 d d_ff`` vs ``2 d d_ff``; STEM's row traffic
   ``uniq(BL) d_ff`` / ``B_uniq d_ff`` (symbolic; only an upper bound is numeric).
2. **§3.1 saving fraction** ``d_ff / (4d + 2L + 3 d_ff)`` of one decoder layer (attention counted as
   multi-head, ``4 L d^2 + 2 L^2 d`` MACs; no LM head).
3. **Exact matmul FLOPs** of the whole model per sequence, in FLOPs (2 per MAC, the convention of
   ``torch.utils.flop_counter.FlopCounterMode``), forward and training = 3 x forward
   (grad-input + grad-weight matmuls): GQA-aware q/k/v/o projections, attention scores and values
   (``2 L^2 h d_head`` each, the full ``L x L`` product: causal masking is *not* halved, as megatron's
   local attention computes it), FFN per layer plan and variant, LM head ``2 L d V``. Elementwise ops,
   norms, RoPE, softmax, biases and the table lookup are not matmuls and are not counted. This is what
   ``tests/test_flops.py`` checks for equality against FlopCounterMode on a real megatron GPTModel.
4. **Parameters**: analytic totals / active (no megatron needed), and with ``--params`` the count of
   the megatron-core model this repo builds (``stem_megatron.model.params.count_parameters``).

Plus the paper's training ROI (accuracy / training FLOPs, normalised to a baseline row, Table 3).

Models: a preset name from ``recipes/flops/`` (HF-style, e.g. ``qwen2.5_7b``) or ``recipes/model/``
(this repo's ``ModelConfig`` fields, e.g. ``mobilellm_350m``), a glob over those names
(``'qwen2.5_*'``), or a path to an HF ``config.json`` / YAML.

Run ``stem-flops --help``; see docs/flops.md.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import json
import logging
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

from stem_megatron.layer_plan import RATIOS, VARIANTS, stem_layer_indices

REPO = Path(__file__).resolve().parents[1]
PRESET_DIRS = (REPO / "recipes" / "flops", REPO / "recipes" / "model")
VARIANT_RECIPES = REPO / "recipes" / "variant"
DEFAULT_SEQ_LENGTH = 4096  # the paper's §3.1 context length

HF_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "vocab_size")
MODEL_CONFIG_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size")
# matmuls per token in one FFN layer, by variant (W_g, W_u, W_d as applicable)
FFN_MATMULS = {"dense": 3, "stem": 2, "stem_gate": 2, "stem_dagger": 3, "hash_moe": 3}
PLAN_RATIOS = ("all", "full", "1/2", "1/3")  # "all": every layer (the paper's §3.1); "full": all but layer 0


class FlopsError(ValueError):
    """Bad input (missing/invalid config field, unknown preset, bad results row); the message names it."""


# --------------------------------------------------------------------------------------------------
# Architectures


@dataclass(frozen=True)
class Arch:
    """The shape fields the counts need (SwiGLU FFN, GQA attention, RMSNorm)."""

    name: str
    hidden_size: int  # d
    ffn_hidden_size: int  # d_ff
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int
    seq_length: int | None = None  # default context for this preset (None: DEFAULT_SEQ_LENGTH)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2/2.5 have q/k/v biases: parameters only, never FLOPs
    source: str = ""

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


def _int_field(cfg: Mapping, key: str, where: str, required: bool = True, default: Any = None) -> Any:
    if key not in cfg or cfg[key] is None:
        if required:
            raise FlopsError(f"{where}: missing field '{key}'")
        return default
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FlopsError(f"{where}: field '{key}' must be a positive integer, got {value!r}")
    return value


def _check_heads(arch: Arch, heads_field: str, kv_field: str, where: str) -> Arch:
    if arch.num_attention_heads % arch.num_kv_heads:
        raise FlopsError(f"{where}: field '{kv_field}'={arch.num_kv_heads} does not divide "
                         f"'{heads_field}'={arch.num_attention_heads}")
    return arch


def arch_from_hf(cfg: Mapping, name: str = "model", source: str = "") -> Arch:
    """An HF ``config.json``-style mapping (hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, vocab_size; optional head_dim, tie_word_embeddings,
    seq_length, qkv_bias). A missing field raises FlopsError naming it."""
    where = source or name
    missing = [k for k in HF_FIELDS if cfg.get(k) is None]
    if missing:
        hint = (" (for multi-head attention set num_key_value_heads = num_attention_heads)"
                if missing == ["num_key_value_heads"] else "")
        raise FlopsError(f"{where}: missing field{'s' if len(missing) > 1 else ''} "
                         f"{', '.join(repr(k) for k in missing)} in the HF config{hint}")
    d = _int_field(cfg, "hidden_size", where)
    heads = _int_field(cfg, "num_attention_heads", where)
    head_dim = _int_field(cfg, "head_dim", where, required=False)
    if head_dim is None:
        if d % heads:
            raise FlopsError(f"{where}: 'hidden_size'={d} is not divisible by 'num_attention_heads'={heads}; "
                             f"set 'head_dim'")
        head_dim = d // heads
    arch = Arch(
        name=str(cfg.get("name") or name), hidden_size=d,
        ffn_hidden_size=_int_field(cfg, "intermediate_size", where),
        num_layers=_int_field(cfg, "num_hidden_layers", where),
        num_attention_heads=heads, num_kv_heads=_int_field(cfg, "num_key_value_heads", where),
        vocab_size=_int_field(cfg, "vocab_size", where), head_dim=head_dim,
        seq_length=_int_field(cfg, "seq_length", where, required=False),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("qkv_bias", False)), source=source,
    )
    return _check_heads(arch, "num_attention_heads", "num_key_value_heads", where)


def arch_from_model_config(cfg: Mapping, name: str = "model", source: str = "") -> Arch:
    """This repo's ``ModelConfig`` fields (recipes/model/*.yaml): untied embeddings, no biases."""
    where = source or name
    for key in MODEL_CONFIG_FIELDS:
        _int_field(cfg, key, where)
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if d % heads:
        raise FlopsError(f"{where}: 'hidden_size'={d} is not divisible by 'num_attention_heads'={heads}")
    arch = Arch(
        name=str(cfg.get("name") or name), hidden_size=d, ffn_hidden_size=cfg["ffn_hidden_size"],
        num_layers=cfg["num_layers"], num_attention_heads=heads,
        num_kv_heads=_int_field(cfg, "num_query_groups", where, required=False, default=heads),
        vocab_size=cfg["vocab_size"], head_dim=d // heads,
        seq_length=_int_field(cfg, "seq_length", where, required=False), source=source,
    )
    return _check_heads(arch, "num_attention_heads", "num_query_groups", where)


def arch_from_mapping(cfg: Mapping, name: str = "model", source: str = "") -> Arch:
    """HF-style if it has any HF-only key, this repo's ModelConfig if it has ``ffn_hidden_size``."""
    if not isinstance(cfg, Mapping):
        raise FlopsError(f"{source or name}: expected a mapping of config fields, got {type(cfg).__name__}")
    if "ffn_hidden_size" in cfg and not any(k in cfg for k in ("intermediate_size", "num_hidden_layers")):
        return arch_from_model_config(cfg, name, source)
    return arch_from_hf(cfg, name, source)


def _read_mapping(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise FlopsError(f"{path}: cannot read ({e.strerror})") from None
    try:
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise FlopsError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}") from None


def list_presets() -> dict[str, Path]:
    """Preset name -> file (recipes/flops first, then recipes/model)."""
    presets: dict[str, Path] = {}
    for directory in PRESET_DIRS:
        for path in sorted(directory.glob("*.yaml")):
            presets.setdefault(path.stem, path)
    return presets


def load_arch(spec: str) -> Arch:
    """A preset name or a path to an HF config.json / YAML (either field convention)."""
    path = Path(spec)
    presets = list_presets()
    if spec in presets:
        path = presets[spec]
    elif not path.is_file():
        raise FlopsError(f"unknown model {spec!r}: not a file and not a preset "
                         f"({', '.join(sorted(presets))})")
    try:
        shown = str(path.relative_to(REPO))
    except ValueError:
        shown = str(path)
    return arch_from_mapping(_read_mapping(path), name=path.stem if path.name != "config.json" else
                             path.parent.name, source=shown)


def expand_models(specs: Sequence[str]) -> list[str]:
    """Globs over preset names expand (sorted); everything else passes through."""
    out: list[str] = []
    presets = list_presets()
    for spec in specs:
        if any(c in spec for c in "*?[") and not Path(spec).exists():
            matches = sorted(fnmatch.filter(presets, spec), key=_natural)
            if not matches:
                raise FlopsError(f"no preset matches {spec!r} ({', '.join(sorted(presets))})")
            out += matches
        else:
            out.append(spec)
    return out


def _natural(name: str) -> tuple:
    """qwen2.5_1.5b < qwen2.5_3b < qwen2.5_14b: sort by the parameter count in the name when there is one."""
    tail = name.rsplit("_", 1)[-1].lower().rstrip("bm")
    try:
        return (name.rsplit("_", 1)[0], float(tail), name)
    except ValueError:
        return (name, 0.0, name)


# --------------------------------------------------------------------------------------------------
# Variants and layer plans


@dataclass(frozen=True)
class Variant:
    """Which FFN layers are replaced and by what (mirrors STEMConfig; ratio "all" = every layer)."""

    variant: str = "stem"
    ratio: str = "1/3"
    layers: tuple[int, ...] | None = None
    num_experts: int = 16
    expert_ffn_hidden_size: int | None = None

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise FlopsError(f"variant {self.variant!r} is not one of {sorted(VARIANTS)}")
        if self.ratio != "all" and self.ratio not in RATIOS:
            raise FlopsError(f"ratio {self.ratio!r} is not one of {sorted(RATIOS) + ['all']}")

    @property
    def label(self) -> str:
        if self.variant == "dense":
            return "dense"
        plan = f"layers {list(self.layers)}" if self.layers is not None else self.ratio
        return f"{self.variant}-{plan}"

    def replaced(self, num_layers: int) -> list[int]:
        """0-based replaced layers (empty for dense)."""
        if self.variant == "dense":
            return []
        if self.layers is None and self.ratio == "all":
            return list(range(num_layers))
        try:
            return stem_layer_indices(num_layers, self.ratio, self.layers)
        except ValueError as e:
            raise FlopsError(str(e)) from None

    def expert_width(self, arch: Arch) -> int:
        return self.expert_ffn_hidden_size or arch.ffn_hidden_size


DENSE = Variant("dense", "0")


def variant_from_stem_config(stem: Any) -> Variant:
    """The ``Variant`` of a ``STEMConfig`` (or its dict from config.json)."""
    get = (lambda k, d=None: stem.get(k, d)) if isinstance(stem, Mapping) else (lambda k, d=None: getattr(stem, k, d))
    if get("variant", "dense") == "dense":
        return DENSE
    layers = get("layers")
    return Variant(variant=get("variant"), ratio=str(get("ratio", "1/3")),
                   layers=tuple(layers) if layers is not None else None, num_experts=get("num_experts", 16),
                   expert_ffn_hidden_size=get("expert_ffn_hidden_size"))


def parse_variant(text: str) -> Variant:
    """``dense``, ``stem``, ``stem-1/3``, ``stem_dagger-full``, ``stem-all``, or a recipes/variant name
    (``stem_1_3``, ``hash_moe``, ...)."""
    text = str(text).strip()
    recipe = VARIANT_RECIPES / f"{text}.yaml"
    if "/" not in text and recipe.is_file():
        cfg = yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}
        return Variant(variant=cfg.get("variant", "stem"), ratio=str(cfg.get("ratio", "1/3")),
                       num_experts=int(cfg.get("num_experts", 16)),
                       expert_ffn_hidden_size=cfg.get("expert_ffn_hidden_size"))
    name, _, ratio = text.partition("-")
    if name == "dense":
        return DENSE
    return Variant(variant=name, ratio=ratio or "1/3")


# --------------------------------------------------------------------------------------------------
# Paper formulas (MACs, the paper's unit)


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


# --------------------------------------------------------------------------------------------------
# Exact matmul FLOPs (2 per MAC)


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


# --------------------------------------------------------------------------------------------------
# Parameters


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


def to_model_config(arch: Arch, seq_length: int | None = None):
    """The repo's ModelConfig for ``arch`` (megatron builds d_head = d / heads, untied, no biases)."""
    from stem_megatron.config import ModelConfig

    if arch.head_dim * arch.num_attention_heads != arch.hidden_size:
        raise FlopsError(f"{arch.name}: head_dim={arch.head_dim} x heads != hidden_size; this repo's megatron "
                         f"model uses d_head = hidden_size / heads, so it cannot build this shape")
    return ModelConfig(name=arch.name, num_layers=arch.num_layers, hidden_size=arch.hidden_size,
                       ffn_hidden_size=arch.ffn_hidden_size, num_attention_heads=arch.num_attention_heads,
                       num_query_groups=arch.num_kv_heads, vocab_size=arch.vocab_size,
                       seq_length=seq_length or arch.seq_length or DEFAULT_SEQ_LENGTH)


def to_stem_config(variant: Variant):
    from stem_megatron.config import STEMConfig

    return STEMConfig(variant=variant.variant, ratio="0" if variant.variant == "dense" else variant.ratio,
                      layers=list(variant.layers) if variant.layers is not None else None,
                      num_experts=variant.num_experts, expert_ffn_hidden_size=variant.expert_ffn_hidden_size,
                      placement="device")


def megatron_parameters(pairs: Iterable[tuple[Arch, Variant]], seed: int = 0) -> list[dict]:
    """``count_parameters`` (megatron GPTModel on the meta device) for each (arch, variant). Starts
    megatron's parallel state as a world of one if it is not running, and tears it down after."""
    from megatron.core import parallel_state

    from stem_megatron import parallel
    from stem_megatron.model.params import count_parameters

    pairs = list(pairs)
    jobs = []
    for arch, variant in pairs:
        if variant.ratio == "all" and variant.layers is None and variant.variant != "dense":
            variant = replace(variant, layers=tuple(range(arch.num_layers)))
        jobs.append((to_model_config(arch), to_stem_config(variant)))
    started = not parallel_state.model_parallel_is_initialized()
    # megatron warns "Unknown MLP type" once per STEM layer (our STEMMLP spec); not news here
    quiet = logging.getLogger("megatron.core.transformer.transformer_layer")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    if started:
        parallel.single_process_env()
        parallel.initialize(1, 1, seed)
    try:
        out = []
        for model, stem in jobs:
            c = count_parameters(model, stem)
            out.append({"total": c.total, "tables": c.tables, "inactive_experts": c.inactive_experts,
                        "active": c.active})
        return out
    finally:
        quiet.setLevel(level)
        if started:
            parallel.destroy()


# --------------------------------------------------------------------------------------------------
# One model's report


def estimate(arch: Arch, variant: Variant, seq_length: int | None = None, batch: int = 1) -> dict:
    """Everything but the megatron parameter count, as a JSON-ready dict (fractions as floats)."""
    L = seq_length or arch.seq_length or DEFAULT_SEQ_LENGTH
    d, d_ff = arch.hidden_size, arch.ffn_hidden_size
    dense_train = training_flops(arch, L, DENSE, batch)
    var_train = training_flops(arch, L, variant, batch)
    plans = {}
    if variant.variant != "dense":
        for ratio in PLAN_RATIOS:
            v = replace(variant, ratio=ratio, layers=None)
            plans[ratio] = {"replaced_layers": len(v.replaced(arch.num_layers)),
                            "saving_fraction": float(exact_saving_fraction(arch, L, v))}
    paper = paper_saving_fraction(d, d_ff, L)
    return {
        "model": arch.name,
        "source": arch.source,
        "architecture": {k: v for k, v in asdict(arch).items() if k not in ("name", "source")},
        "seq_length": L,
        "batch": batch,
        "variant": variant.label,
        "replaced_layers": variant.replaced(arch.num_layers),
        "table1_per_layer": table1(d, d_ff, L, batch, arch.vocab_size),
        "paper_saving_fraction": float(paper),
        "paper_saving_percent": round(100 * float(paper), 1),
        "exact": {
            "unit": "matmul FLOPs per batch (2 per multiply-accumulate); training = 3 x forward",
            "layer_saving_fraction": float(exact_layer_saving_fraction(arch, L)),
            "dense": {"forward": forward_flops(arch, L, DENSE, batch), "training": dense_train},
            variant.label: {"forward": forward_flops(arch, L, variant, batch), "training": var_train},
            "saving_fraction": float(Fraction(dense_train["total"] - var_train["total"], dense_train["total"])),
            "plans": plans,
            "training_flops_per_token": {"dense": dense_train["total"] / (batch * L),
                                         variant.label: var_train["total"] / (batch * L)},
        },
        "parameters": {
            "analytic": {"dense": analytic_parameters(arch, DENSE),
                         variant.label: analytic_parameters(arch, variant)},
        },
    }


# --------------------------------------------------------------------------------------------------
# Training ROI (paper §4, Table 3: accuracy / training FLOPs, normalised to a baseline)

_ALIASES = {
    "name": ("name", "model"),
    "avg_accuracy": ("avg_accuracy", "avg", "accuracy", "avg_acc"),
    "training_tokens": ("training_tokens", "tokens", "train_tokens"),
    "preset": ("preset",),
    "variant": ("variant",),
    "ratio": ("ratio",),
    "seq_length": ("seq_length", "seq_len"),
    "gflops_per_token": ("gflops_per_token", "gflops"),
    "flops_per_token": ("flops_per_token",),
    "training_flops": ("training_flops", "train_flops"),
    "group": ("group", "scale"),
    "baseline": ("baseline",),
}


def load_results(path: str | Path) -> list[dict]:
    """Rows from a JSON list (or {"rows": [...]}) or a CSV with a header; keys are normalised
    (case, spaces and dashes) and aliases resolved (see _ALIASES)."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        try:
            with path.open(newline="", encoding="utf-8") as f:
                raw = list(csv.DictReader(f))
        except OSError as e:
            raise FlopsError(f"{path}: cannot read ({e.strerror})") from None
    else:
        data = _read_mapping(path)
        raw = data.get("rows") if isinstance(data, Mapping) else data
        if not isinstance(raw, list):
            raise FlopsError(f"{path}: expected a list of rows or {{\"rows\": [...]}}")
    rows = []
    for i, r in enumerate(raw):
        if not isinstance(r, Mapping):
            raise FlopsError(f"{path}: row {i + 1} is not a mapping")
        norm = {str(k).strip().lower().replace(" ", "_").replace("-", "_"): v for k, v in r.items()}
        row = {}
        for key, names in _ALIASES.items():
            for n in names:
                if norm.get(n) not in (None, ""):
                    row[key] = norm[n]
                    break
        row["_where"] = f"{path} row {i + 1}" + (f" ({row['name']})" if "name" in row else "")
        rows.append(row)
    return rows


def _number(row: dict, key: str) -> float:
    try:
        value = float(row[key])
    except KeyError:
        raise FlopsError(f"{row['_where']}: missing field '{key}'") from None
    except (TypeError, ValueError):
        raise FlopsError(f"{row['_where']}: field '{key}' is not a number: {row[key]!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise FlopsError(f"{row['_where']}: field '{key}' must be positive, got {row[key]!r}")
    return value


def _truthy(value: Any) -> bool:
    return value is True or str(value).strip().lower() in ("1", "true", "yes", "y")


def row_training_flops(row: dict, seq_length: int | None = None) -> tuple[float, str]:
    """Training FLOPs of one results row and how they were obtained."""
    if "training_flops" in row:
        return _number(row, "training_flops"), "training_flops (given)"
    tokens = _number(row, "training_tokens")
    if "flops_per_token" in row:
        return tokens * _number(row, "flops_per_token"), "tokens x flops_per_token (given)"
    if "gflops_per_token" in row:
        return tokens * 1e9 * _number(row, "gflops_per_token"), "tokens x gflops_per_token (given)"
    if "preset" not in row:
        raise FlopsError(f"{row['_where']}: missing field 'preset' (or 'training_flops' / 'flops_per_token' / "
                         f"'gflops_per_token')")
    arch = load_arch(str(row["preset"]))
    variant = parse_variant(str(row.get("variant", "dense")))
    if "ratio" in row and variant.variant != "dense":
        variant = replace(variant, ratio=str(row["ratio"]))
    L = int(_number(row, "seq_length")) if "seq_length" in row else seq_length or arch.seq_length or \
        DEFAULT_SEQ_LENGTH
    per_token = training_flops(arch, L, variant)["total"] / L
    return tokens * per_token, f"tokens x exact training FLOPs/token ({arch.name}, {variant.label}, L={L})"


def training_roi(rows: list[dict], baseline: str | None = None, seq_length: int | None = None) -> list[dict]:
    """ROI = avg accuracy / training FLOPs, and ROI / ROI of the baseline in the row's group (rows group
    by 'group', else 'preset'). Baseline per group: ``baseline`` (a row name, all groups), else the row
    flagged ``baseline``, else the group's dense row."""
    out = []
    for row in rows:
        if "name" not in row:
            raise FlopsError(f"{row['_where']}: missing field 'name'")
        acc = _number(row, "avg_accuracy")
        flops, how = row_training_flops(row, seq_length)
        group = str(row.get("group", row.get("preset", "")))
        out.append({"name": str(row["name"]), "group": group, "avg_accuracy": acc, "training_flops": flops,
                    "flops_from": how, "roi": acc / flops, "_row": row})
    by_group: dict[str, list[dict]] = {}
    for r in out:
        by_group.setdefault(r["group"], []).append(r)
    if baseline is not None:
        named = [r for r in out if r["name"] == baseline]
        if not named:
            raise FlopsError(f"--baseline {baseline!r} is not a row name ({', '.join(r['name'] for r in out)})")
    for group, members in by_group.items():
        if baseline is not None:
            base = named[0]
        else:
            flagged = [r for r in members if _truthy(r["_row"].get("baseline", False))]
            dense = [r for r in members if str(r["_row"].get("variant", "")).strip().lower() == "dense"]
            base = (flagged or dense or [None])[0]
            if base is None:
                raise FlopsError(f"group {group!r} has no baseline row: flag one with 'baseline: true', give it "
                                 f"variant 'dense', or pass --baseline NAME")
        for r in members:
            r["baseline"] = base["name"]
            r["roi_normalised"] = r["roi"] / base["roi"]
    for r in out:
        del r["_row"]
    return out


# --------------------------------------------------------------------------------------------------
# CLI


def _pct(x: float, digits: int = 1) -> str:
    return f"{100 * x:.{digits}f}%"


def _print_report(rep: dict) -> None:
    a = rep["architecture"]
    print(f"== {rep['model']}" + (f"  ({rep['source']})" if rep["source"] else ""))
    print(f"   d={a['hidden_size']} d_ff={a['ffn_hidden_size']} layers={a['num_layers']} "
          f"heads={a['num_attention_heads']} kv_heads={a['num_kv_heads']} head_dim={a['head_dim']} "
          f"V={a['vocab_size']}   L={rep['seq_length']} B={rep['batch']}")
    t = rep["table1_per_layer"]
    p, m, c = t["prefill_training_flops"], t["decoding_parameter_loading"], t["communication"]
    print("   Table 1, per FFN layer (multiply-accumulates)       FFN             STEM          saving")
    print(f"     prefill/training  B(3|2 d_ff d L + d_ff L)  {p['ffn']:>15,} {p['stem']:>15,} {p['saving']:>15,}"
          f"  (= B d d_ff L)")
    print(f"     decoding param loading  3|2 d d_ff          {m['ffn']:>15,} {m['stem']:>15,} {m['saving']:>15,}")
    print(f"     communication (train)   0 | uniq(BL) d_ff   (<= {c['prefill_training']['stem_upper_bound']:,} values; "
          f"x2 in training)")
    print(f"     communication (decode)  0 | B_uniq d_ff     (<= {c['decoding']['stem_upper_bound']:,} values)")
    e = rep["exact"]
    print(f"   §3.1 saving fraction d_ff/(4d+2L+3d_ff):        {_pct(rep['paper_saving_fraction'], 2)}")
    print(f"   exact, one layer (GQA q/k/v widths, no LM head): {_pct(e['layer_saving_fraction'], 2)}")
    label = rep["variant"]
    if label != "dense":
        print(f"   exact whole-model matmul FLOPs per batch, training (3 x forward), {label} "
              f"({len(rep['replaced_layers'])}/{a['num_layers']} layers replaced):")
        print(f"     {'':24}{'dense':>20}{label:>24}")
        for k in ("attention_projections", "attention_core", "ffn", "lm_head", "total"):
            print(f"     {k:24}{e['dense']['training'][k]:>20,}{e[label]['training'][k]:>24,}")
        print(f"     saving fraction: {_pct(e['saving_fraction'], 2)};  by plan: " + ", ".join(
            f"{r} ({v['replaced_layers']} layers) {_pct(v['saving_fraction'], 2)}" for r, v in e["plans"].items()))
    else:
        print(f"   exact training matmul FLOPs per batch: {e['dense']['training']['total']:,}")
    for kind, counts in rep["parameters"].items():
        for name, pc in counts.items():
            extra = ""
            if kind == "analytic":
                extra = f"  [{'tied' if pc['tied_embeddings'] else 'untied'} embeddings" + \
                        (", q/k/v biases]" if pc["qkv_bias"] else "]")
            print(f"   params {kind + ':':<10}{name:>16}: total {pc['total']:>15,}  active {pc['active']:>14,}"
                  f"  tables {pc['tables']:>15,}{extra}")


def _print_summary(reports: list[dict]) -> None:
    label = reports[0]["variant"]
    print("\nSummary (saving fraction of training matmul FLOPs)")
    head = f"{'model':<16}{'L':>6}{'§3.1 formula':>14}{'exact layer':>13}{'exact all':>11}"
    if label != "dense":
        head += f"{'exact ' + label:>22}"
    print(head)
    for rep in reports:
        e = rep["exact"]
        line = (f"{rep['model']:<16}{rep['seq_length']:>6}{_pct(rep['paper_saving_fraction'], 2):>14}"
                f"{_pct(e['layer_saving_fraction'], 2):>13}")
        line += f"{_pct(e['plans']['all']['saving_fraction'], 2) if e['plans'] else '-':>11}"
        if label != "dense":
            line += f"{_pct(e['saving_fraction'], 2):>22}"
        print(line)


def _print_roi(rows: list[dict]) -> None:
    print(f"{'model':<20}{'group':<16}{'avg acc':>9}{'train FLOPs':>14}{'ROI (norm.)':>13}  baseline")
    for r in rows:
        print(f"{r['name']:<20}{r['group']:<16}{r['avg_accuracy']:>9.2f}{r['training_flops']:>14.4g}"
              f"{r['roi_normalised']:>12.2f}x  {r['baseline']}")
    exact = sum(r["flops_from"].startswith("tokens x exact") for r in rows)
    parts = [f"{exact} row(s): training tokens x exact training matmul FLOPs/token of preset + variant"] if exact \
        else []
    if len(rows) > exact:
        parts.append(f"{len(rows) - exact} row(s): given in the file")
    print("training FLOPs: " + "; ".join(parts) + " (details: --json, 'flops_from')")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stem-flops",
        description="FLOPs, parameters and training ROI of STEM vs dense SwiGLU transformers "
                    "(paper Table 1, §3.1, Table 3). See docs/flops.md.")
    parser.add_argument("models", nargs="*",
                        help="preset names (recipes/flops, recipes/model), globs over them ('qwen2.5_*'), "
                             "or paths to an HF config.json / YAML")
    parser.add_argument("-L", "--seq-len", type=int, default=None,
                        help=f"context length L (default: the preset's seq_length, else {DEFAULT_SEQ_LENGTH})")
    parser.add_argument("-B", "--batch", type=int, default=1, help="sequences per batch B (default 1)")
    parser.add_argument("--variant", default="stem",
                        help="dense | stem | stem_dagger | stem_gate | hash_moe, optionally with -RATIO "
                             "(stem-1/2), or a recipes/variant name (stem_full). Default: stem")
    parser.add_argument("--ratio", default=None,
                        help="replaced-layer plan: 1/3 | 1/2 | full (all but layer 0) | all (every layer, "
                             "as §3.1 assumes). Default: from --variant, else 1/3")
    parser.add_argument("--layers", default=None, help="explicit 0-based replaced layers, comma separated")
    parser.add_argument("--num-experts", type=int, default=None, help="hash_moe: experts per replaced layer")
    parser.add_argument("--expert-ffn", type=int, default=None, help="hash_moe: expert d_ff (default d_ff)")
    parser.add_argument("--params", action="store_true",
                        help="also count parameters of the megatron-core model this repo builds "
                             "(starts megatron as a world of one; a few seconds)")
    parser.add_argument("--roi", metavar="RESULTS", default=None,
                        help="training ROI from a results JSON/CSV (name, avg_accuracy, training_tokens, "
                             "preset, variant[, ratio, group, baseline, gflops_per_token, training_flops])")
    parser.add_argument("--baseline", default=None, help="ROI: normalise every row to this row name")
    parser.add_argument("--list", action="store_true", help="list the presets and exit")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    return parser


def _variant_from_args(args) -> Variant:
    variant = parse_variant(args.variant)
    if args.ratio is not None and variant.variant != "dense":
        variant = replace(variant, ratio=args.ratio)
    if args.layers is not None:
        try:
            layers = tuple(int(x) for x in args.layers.split(",") if x.strip())
        except ValueError:
            raise FlopsError(f"--layers {args.layers!r}: expected comma-separated integers") from None
        variant = replace(variant, layers=layers)
    if args.num_experts is not None:
        variant = replace(variant, num_experts=args.num_experts)
    if args.expert_ffn is not None:
        variant = replace(variant, expert_ffn_hidden_size=args.expert_ffn)
    return variant


def run(argv: Sequence[str] | None = None) -> dict:
    """Parse ``argv``, compute, print (text or JSON) and return the JSON-ready result."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        presets = {name: str(path.relative_to(REPO))
                   for name, path in sorted(list_presets().items(), key=lambda kv: _natural(kv[0]))}
        if args.json:
            print(json.dumps({"presets": presets}, indent=2))
        else:
            for name, path in presets.items():
                print(f"{name:<20}{path}")
        return {"presets": presets}
    if not args.models and not args.roi:
        parser.error("give at least one model (preset, glob or config path), --roi RESULTS, or --list")
    if args.seq_len is not None and args.seq_len < 1:
        parser.error("--seq-len must be >= 1")
    if args.batch < 1:
        parser.error("--batch must be >= 1")
    result: dict[str, Any] = {}
    variant = _variant_from_args(args)
    archs = [load_arch(spec) for spec in expand_models(args.models)]
    reports = [estimate(arch, variant, args.seq_len, args.batch) for arch in archs]
    if args.params and archs:
        counted = megatron_parameters([(a, v) for a in archs for v in (DENSE, variant)])
        for i, rep in enumerate(reports):
            dense_c, var_c = counted[2 * i], counted[2 * i + 1]
            rep["parameters"]["megatron"] = {"dense": dense_c, variant.label: var_c}
            # the analytic count of the same architecture (untied, no biases) must agree exactly
            rep["megatron_matches_analytic"] = all(
                {k: analytic_parameters(archs[i], v, tied=False, qkv_bias=False)[k]
                 for k in ("total", "tables", "active")} == {k: c[k] for k in ("total", "tables", "active")}
                for v, c in ((DENSE, dense_c), (variant, var_c)))
    if reports:
        result["models"] = reports
    if args.roi:
        result["roi"] = training_roi(load_results(args.roi), args.baseline, args.seq_len)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for rep in reports:
            _print_report(rep)
            if rep.get("megatron_matches_analytic") is False:
                print("   warning: the megatron count differs from the analytic count of the model as built "
                      "(untied, no biases)")
        if len(reports) > 1:
            _print_summary(reports)
        if "roi" in result:
            if reports:
                print()
            _print_roi(result["roi"])
    return result


def main(argv: Sequence[str] | None = None) -> None:
    try:
        run(argv)
    except FlopsError as e:
        print(f"stem-flops: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
