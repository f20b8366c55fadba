"""Per-layer ModuleSpecs: megatron-core's GPT layer spec with the MLP swapped on the planned layers.

We start from megatron's own decoder block spec (which already slices layers for this pipeline
stage) and replace ``submodules.mlp`` of the planned layers by a STEM MLP (or the Hash-MoE layer).
Layers not in the plan keep megatron's SwiGLU ``MLP`` (paper eq. 1). On GPU the linears are
Transformer Engine's; on CPU the local megatron-core ones, both from megatron's spec providers.
Without TE every layer's core attention is ``SDPAttention`` (torch's SDPA kernels) in place of megatron's
local ``DotProductAttention``, which materialises the s x s scores of every layer; with TE it stays TE's.

Under TE a dense layer's pre-MLP RMSNorm is fused into ``linear_fc1`` (``pre_mlp_layernorm`` is an
``IdentityOp``); a replaced layer has no ``linear_fc1``, so it gets the norm back as a module of its own.
Its checkpoint key is the one megatron's local spec uses for that norm (``mlp.linear_fc1.layer_norm_weight``),
so TE and local runs save and load the same keys.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from stem_megatron.model.device_table import DeviceRowTable
from stem_megatron.model.sdpa_attention import SDPAttention
from stem_megatron.model.stem_mlp import STEMMLP, STEMMLPSubmodules


def linear_classes(use_te: bool):
    """Column/row-parallel linear classes for the device, from the provider megatron's own layer specs use:
    TE on GPU, megatron-core local on CPU."""
    if use_te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        backend = TESpecProvider()
    else:
        backend = LocalSpecProvider()
    return backend.column_parallel_linear(), backend.row_parallel_linear()


def device_rows(table_init: str = "scaled", table_init_std: Optional[float] = None, seed: int = 0) -> ModuleSpec:
    """Row source keeping ``U_l`` as a device parameter (reference path, small runs)."""
    params = {"table_init": table_init, "init_std": table_init_std, "seed": seed}
    return ModuleSpec(module=DeviceRowTable, params=params)


def stem_mlp_spec(
    variant: str,
    vocab_size: int,
    row_source: Optional[ModuleSpec] = None,
    use_te: bool = False,
) -> ModuleSpec:
    """ModuleSpec of one STEM-family MLP; ``row_source`` decides where ``U_l`` lives."""
    column, row = linear_classes(use_te)
    return ModuleSpec(
        module=STEMMLP,
        submodules=STEMMLPSubmodules(W_g=column, W_u=column, W_d=row, U_l=row_source or device_rows()),
        params={"variant": variant, "vocab_size": vocab_size},
    )


def _replaced(layer: ModuleSpec, mlp: ModuleSpec, norm: type) -> ModuleSpec:
    """``layer`` with ``mlp``, a pre-MLP norm module of its own (``norm``: the block's RMSNorm class, TE's on
    GPU) where the dense spec had fused it into ``linear_fc1``, and that norm's checkpoint key fixed."""
    sub = layer.submodules
    pre_mlp_norm = norm if sub.pre_mlp_layernorm is IdentityOp else sub.pre_mlp_layernorm
    keys = {**sub.sharded_state_dict_keys_map, "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    sub = dataclasses.replace(sub, mlp=mlp, pre_mlp_layernorm=pre_mlp_norm, sharded_state_dict_keys_map=keys)
    return dataclasses.replace(layer, submodules=sub)


def _with_attn_mask_type(layer: ModuleSpec, attn_mask_type: AttnMaskType) -> ModuleSpec:
    attention = layer.submodules.self_attention
    attention = dataclasses.replace(attention, params={**attention.params, "attn_mask_type": attn_mask_type})
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention))


def with_core_attention(layer: ModuleSpec, core_attention: type) -> ModuleSpec:
    """``layer`` whose self-attention computes its core attention with ``core_attention`` (a class taking
    megatron's core-attention constructor arguments, as ``DotProductAttention``)."""
    attention = layer.submodules.self_attention
    attention = dataclasses.replace(
        attention, submodules=dataclasses.replace(attention.submodules, core_attention=core_attention))
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention))


def decoder_block_spec(
    config: TransformerConfig,
    replaced_layers: Sequence[int],
    mlp: ModuleSpec,
    use_te: bool = False,
    pp_rank: Optional[int] = None,
    attn_mask_type: AttnMaskType = AttnMaskType.causal,
) -> TransformerBlockSubmodules:
    """This pipeline stage's layer specs, with ``mlp`` at the global indices in ``replaced_layers``.

    ``attn_mask_type=AttnMaskType.arbitrary`` makes attention obey the ``attention_mask`` passed to
    the forward (cross-document masking of packed samples). With ``causal`` the local attention
    (``SDPAttention``, as megatron's ``DotProductAttention`` in fp32) applies an explicit mask and
    Transformer Engine attention ignores it. ``arbitrary`` needs the mask on every forward: without
    one, attention is bidirectional.
    """
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm", pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
    wanted = set(replaced_layers)
    layer_specs = [_replaced(spec, mlp, block.layer_norm) if offset + i in wanted else spec
                   for i, spec in enumerate(block.layer_specs)]
    layer_specs = [_with_attn_mask_type(spec, attn_mask_type) for spec in layer_specs]
    if not use_te:
        layer_specs = [with_core_attention(spec, SDPAttention) for spec in layer_specs]
    return dataclasses.replace(block, layer_specs=layer_specs)
