"""Parameter bytes a decode step loads, STEM vs a dense model of the same shape (paper Table 1, decoding rows).

``ByteBudget`` counts them from an export's parameter names and shapes; ``stem-generate`` reports them
per forward next to the rows it actually fetched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:
    import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EMBEDDING = "embedding.word_embeddings.weight"


@dataclass(frozen=True)
class ByteBudget:
    """Parameter bytes one forward loads, for a STEM model and a dense model of the same shape.

    Counted per forward (one decode step of the whole batch):

    * ``weight_bytes``: every parameter except the STEM tables and the input embedding, loaded whole
      (attention, norms, dense FFNs, the STEM layers' ``W_g``/``W_u``/``W_d``, the output layer);
    * input embedding: ``B_uniq`` rows of ``d`` (the same in both models);
    * STEM rows: ``B_uniq`` rows of ``d_ff`` per STEM layer.

    The dense model of the same shape has a SwiGLU FFN (``W_g``, ``W_u``, ``W_d``: ``3 d d_ff``) where
    the STEM model has a STEM layer, so for ``stem`` it loads ``d x d_ff`` more per replaced layer (the
    up-projection) and no rows: Table 1's decoding parameter loading ``3 d d_ff`` vs ``2 d d_ff`` per
    layer, plus the ``B_uniq d_ff`` rows STEM moves instead. For ``stem_dagger`` (which keeps ``W_u``)
    the dense model loads the same weights and no rows. Models without tables (dense, Hash-MoE) count
    every non-embedding parameter as loaded.
    """

    hidden_size: int
    ffn_hidden_size: int
    element_size: int  # bytes per parameter (fp32 exports: 4)
    stem_layers: tuple[int, ...]  # global 0-based indices of the layers with a U_l table
    weight_bytes: int
    stem_layer_weight_bytes: int  # W_g/W_u/W_d of one STEM layer (0 without STEM layers)
    table_bytes: int  # all U_l tables

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, Sequence[int]], element_size: int = 4) -> "ByteBudget":
        """From the single-process model's ``{parameter name: shape}`` (an export's weights)."""
        numel = {name: _numel(shape) for name, shape in shapes.items()}
        if _EMBEDDING not in shapes:
            raise ValueError(f"no {_EMBEDDING} among the parameters: not a single-process GPT model")
        vocab, d = shapes[_EMBEDDING]
        tables = {int(_LAYER.match(n).group(1)): n for n in shapes if n.endswith(".mlp.U_l.weight")}
        d_ff = _numel(shapes[next(iter(tables.values()))]) // vocab if tables else 0
        weights = sum(n for name, n in numel.items() if name != _EMBEDDING and name not in tables.values())
        per_layer = {i: sum(n for name, n in numel.items()
                            if name.startswith(f"decoder.layers.{i}.mlp.") and name != tables[i]) for i in tables}
        if len(set(per_layer.values())) > 1:
            raise ValueError(f"STEM layers of different shapes: {per_layer}")
        return cls(hidden_size=d, ffn_hidden_size=d_ff, element_size=element_size, stem_layers=tuple(sorted(tables)),
                   weight_bytes=weights * element_size,
                   stem_layer_weight_bytes=next(iter(per_layer.values()), 0) * element_size,
                   table_bytes=sum(numel[n] for n in tables.values()) * element_size)

    @classmethod
    def from_weights(cls, weights: Mapping[str, torch.Tensor]) -> "ByteBudget":
        """From an export's weights, at their precision (bytes per element of the input embedding)."""
        return cls.from_shapes({n: w.shape for n, w in weights.items()}, weights[_EMBEDDING].element_size())

    @property
    def dense_ffn_layer_bytes(self) -> int:
        """A SwiGLU FFN layer of the same shape: ``3 d d_ff`` parameters."""
        return 3 * self.hidden_size * self.ffn_hidden_size * self.element_size

    @property
    def dense_model_weight_bytes(self) -> int:
        """``weight_bytes`` of the dense model of the same shape (every replaced layer a SwiGLU FFN)."""
        n = len(self.stem_layers)
        return self.weight_bytes - n * self.stem_layer_weight_bytes + n * self.dense_ffn_layer_bytes

    def step(self, unique_tokens: int) -> dict:
        """Bytes one forward over ``unique_tokens`` distinct ids loads, STEM vs dense, and per layer."""
        u, e = unique_tokens, self.element_size
        embedding = u * self.hidden_size * e
        rows_per_layer = u * self.ffn_hidden_size * e
        rows = rows_per_layer * len(self.stem_layers)
        stem = self.weight_bytes + embedding + rows
        dense = self.dense_model_weight_bytes + embedding
        return {
            "unique_tokens": u,
            "weight_bytes": self.weight_bytes,
            "embedding_row_bytes": embedding,
            "stem_row_bytes": rows,
            "stem_bytes": stem,
            "dense_model_bytes": dense,
            "saved_bytes": dense - stem,
            "stem_over_dense": stem / dense,
            # Table 1, decoding rows, one replaced FFN layer
            "layer_dense_ffn_bytes": self.dense_ffn_layer_bytes if self.stem_layers else 0,
            "layer_stem_ffn_bytes": self.stem_layer_weight_bytes,
            "layer_stem_row_bytes": rows_per_layer if self.stem_layers else 0,
        }


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
