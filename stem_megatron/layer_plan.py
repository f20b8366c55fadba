"""Which FFN layers become STEM layers (paper §4.4.1: uniform intervals; "full" = all but the first)."""

from __future__ import annotations

from fractions import Fraction
from typing import Optional, Sequence

VARIANTS = {"dense", "stem", "stem_dagger", "stem_gate", "hash_moe"}
RATIOS = {"0": Fraction(0), "1/3": Fraction(1, 3), "1/2": Fraction(1, 2), "full": None}


def stem_layer_indices(num_layers: int, ratio: str, layers: Optional[Sequence[int]] = None) -> list[int]:
    """0-based indices of the replaced layers.

    ``ratio`` r picks ``floor(r*N)`` layers, the last of each block of ``N/count`` layers, so with N=24
    and r=1/3 the layers 2, 5, ..., 23 are replaced and layer 0 never is. An explicit ``layers`` list
    wins over the ratio.
    """
    if layers is not None:
        bad = [i for i in layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(
                f"STEM layer indices {bad} are out of range for num_layers={num_layers} (0..{num_layers - 1})"
            )
        if len(set(layers)) != len(layers):
            raise ValueError(f"STEM layer indices {list(layers)} contain duplicates")
        return sorted(layers)
    if ratio not in RATIOS:
        raise ValueError(f"ratio {ratio!r} is not one of {sorted(RATIOS)}")
    if RATIOS[ratio] is None:
        return list(range(1, num_layers))
    count = int(RATIOS[ratio] * num_layers)
    return [(j + 1) * num_layers // count - 1 for j in range(count)]


def planned_layers(num_layers: int, stem) -> list[int]:
    """Global 0-based indices of the replaced (STEM or Hash-MoE) layers of a run (``stem``: its STEMConfig)."""
    return [] if stem.variant == "dense" else stem_layer_indices(num_layers, stem.ratio, stem.layers)
