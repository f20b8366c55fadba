"""Which FFN layers a model replaces and by what: a ``Variant`` from a name (``stem-1/3``), a
recipes/variant file or a ``STEMConfig`` and ``HashMoEConfig``, and back to those."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from stem_megatron.flops.arch import REPO, Arch, FlopsError
from stem_megatron.layer_plan import RATIOS, VARIANTS, stem_layer_indices

VARIANT_RECIPES = REPO / "recipes" / "variant"
# matmuls per token in one FFN layer, by variant (W_g, W_u, W_d as applicable)
FFN_MATMULS = {"dense": 3, "stem": 2, "stem_gate": 2, "stem_dagger": 3, "hash_moe": 3}


@dataclass(frozen=True)
class Variant:
    """Which FFN layers are replaced and by what (mirrors STEMConfig and HashMoEConfig; ratio "all" = every layer)."""

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


def variant_from_stem_config(stem: Any, hash_moe: Any = None) -> Variant:
    """The ``Variant`` of a ``STEMConfig`` and ``HashMoEConfig`` (or their dicts from config.json; ``hash_moe``
    None: its defaults)."""
    get, moe = _getter(stem), _getter(hash_moe or {})
    if get("variant", "dense") == "dense":
        return DENSE
    layers = get("layers")
    return Variant(variant=get("variant"), ratio=str(get("ratio", "1/3")),
                   layers=tuple(layers) if layers is not None else None, num_experts=moe("num_experts", 16),
                   expert_ffn_hidden_size=moe("expert_ffn_hidden_size"))


def _getter(cfg: Any):
    """``get(key, default)`` of a config dataclass or its dict."""
    return cfg.get if isinstance(cfg, Mapping) else lambda key, default=None: getattr(cfg, key, default)


def parse_variant(text: str) -> Variant:
    """``dense``, ``stem``, ``stem-1/3``, ``stem_dagger-full``, ``stem-all``, or a recipes/variant name
    (``stem_1_3``, ``hash_moe``, ...: a file of package ``stem``, or a global one with ``stem:`` and ``hash_moe:``)."""
    text = str(text).strip()
    recipe = VARIANT_RECIPES / f"{text}.yaml"
    if "/" not in text and recipe.is_file():
        cfg = yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}
        stem, moe = cfg.get("stem", cfg), cfg.get("hash_moe", {})
        return Variant(variant=stem.get("variant", "stem"), ratio=str(stem.get("ratio", "1/3")),
                       num_experts=int(moe.get("num_experts", 16)),
                       expert_ffn_hidden_size=moe.get("expert_ffn_hidden_size"))
    name, _, ratio = text.partition("-")
    if name == "dense":
        return DENSE
    return Variant(variant=name, ratio=ratio or "1/3")


def to_stem_config(variant: Variant):
    """The ``STEMConfig`` that builds ``variant`` (its table a device parameter, as ``build_gpt`` makes one without
    a row source: what a parameter count needs)."""
    from stem_megatron.config import STEMConfig

    return STEMConfig(variant=variant.variant, ratio="0" if variant.variant == "dense" else variant.ratio,
                      layers=list(variant.layers) if variant.layers is not None else None)


def to_hash_moe_config(variant: Variant):
    """The ``HashMoEConfig`` of ``variant``'s experts."""
    from stem_megatron.config import HashMoEConfig

    return HashMoEConfig(num_experts=variant.num_experts, expert_ffn_hidden_size=variant.expert_ffn_hidden_size)
