"""The STEM FFN (paper eq. 4), STEM† (eq. 5) and the gate-replacement ablation (Table 3).

    stem        y = W_d (SiLU(W_g x) ⊙ U_l[t])
    stem_dagger y = W_d (SiLU(W_g x) ⊙ (W_u x + U_l[t]))
    stem_gate   y = W_d (SiLU(U_l[t]) ⊙ W_u x)

``W_g``/``W_u`` are column-parallel and ``W_d`` row-parallel (megatron-core linears), so each TP rank
works on its d_ff/tp slice end to end; ``U_l`` comes from a row source holding the same slice.
The row source reads the micro-batch's tokens from ``token_context``, so megatron's forward
signatures stay untouched. A row source with ``compact`` (host-resident rows) gives ``stem`` its rows
compact instead, for the one-function product of ``stem_rows``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from stem_megatron.model import token_context
from stem_megatron.model.stem_rows import silu_times_rows

STEM_VARIANTS = ("stem", "stem_dagger", "stem_gate")


@dataclass
class STEMMLPSubmodules:
    W_g: Union[ModuleSpec, type, None] = None
    W_u: Union[ModuleSpec, type, None] = None
    W_d: Union[ModuleSpec, type, None] = None
    U_l: Union[ModuleSpec, type, None] = None


class STEMMLP(MegatronModule):
    """A gated FFN whose up- (or gate-) projection is a token-indexed row of ``U_l``."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: STEMMLPSubmodules,
        variant: str,
        vocab_size: int,
        pg_collection=None,
        is_mtp_layer: bool = False,
        name: Optional[str] = None,
    ):
        """``pg_collection``, ``is_mtp_layer`` and ``name`` are what megatron's ``TransformerLayer`` passes every
        ``mlp`` submodule (megatron-core >= 0.17): the linears use the collection's TP group."""
        super().__init__(config=config)
        del is_mtp_layer, name  # a STEM layer is never a multi-token-prediction layer; names are for logging
        if variant not in STEM_VARIANTS:
            raise ValueError(f"STEM variant {variant!r} is not one of {STEM_VARIANTS}")
        self.variant = variant
        self.layer_number: Optional[int] = None
        d, d_ff = config.hidden_size, config.ffn_hidden_size
        tp_group = getattr(pg_collection, "tp", None)

        def column_parallel(spec, name):
            return build_module(
                spec, d, d_ff, config=config, init_method=config.init_method, gather_output=False,
                bias=False, skip_bias_add=True, is_expert=False, tp_comm_buffer_name=name, tp_group=tp_group,
            )

        if variant in ("stem", "stem_dagger"):
            self.W_g = column_parallel(submodules.W_g, "fc1")
        if variant in ("stem_dagger", "stem_gate"):
            self.W_u = column_parallel(submodules.W_u, "fc1_up")
        self.U_l = build_module(submodules.U_l, config=config, vocab_size=vocab_size)
        self.W_d = build_module(
            submodules.W_d, d_ff, d, config=config, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc2",
            tp_group=tp_group,
        )

    def set_layer_number(self, layer_number: int) -> None:
        """Called by megatron's TransformerLayer with the global 1-based layer number."""
        self.layer_number = layer_number
        if hasattr(self.U_l, "set_layer_number"):
            self.U_l.set_layer_number(layer_number)

    def forward(self, hidden_states: torch.Tensor, **_kwargs):
        """hidden_states [s, b, h] -> (output [s, b, h], None)."""
        tokens = token_context.current()
        if self.variant == "stem" and hasattr(self.U_l, "compact"):
            h = silu_times_rows(self.W_g(hidden_states)[0], *self.U_l.compact(tokens))
        elif self.variant == "stem":
            h = F.silu(self.W_g(hidden_states)[0]) * self.U_l(tokens)  # rows [s, b, d_ff/tp] of the tokens
        elif self.variant == "stem_dagger":
            h = F.silu(self.W_g(hidden_states)[0]) * (self.W_u(hidden_states)[0] + self.U_l(tokens))
        else:
            h = F.silu(self.U_l(tokens)) * self.W_u(hidden_states)[0]
        output, _ = self.W_d(h)
        return output, None
