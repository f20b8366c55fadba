"""The single-process model's weights under transformers' Llama/Qwen2 names, both ways: the export (``writer``) writes
a Hugging Face model with ``split_qkv`` and ``split_fc1``, the import (``checkpoint.hf.load``) reads one with
``to_megatron``. Torch only, like the rest of the format's code here.

megatron fuses two projections a Llama keeps apart: ``linear_qkv`` holds, per query group, its query heads, then one
key and one value head (weights and, with Qwen2's biases, biases alike); ``linear_fc1`` holds [gate; up]. A STEM
layer takes the dense layer's gate and down projections as ``W_g`` and ``W_d`` (and its up-projection as ``W_u``
where the variant keeps one); its ``U_l`` is not in a dense model (``checkpoint.hf.calibration``).
"""

from __future__ import annotations

import re
from typing import Callable, Optional

import torch

TOP = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
       "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# a layer's weights that are one HF tensor each (STEM's gate, up and down: the dense layer's)
PLAIN = {"input_layernorm.weight": "input_layernorm.weight",
         "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
         "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
         "mlp.linear_fc2.weight": "mlp.down_proj.weight",
         "mlp.W_g.weight": "mlp.gate_proj.weight", "mlp.W_u.weight": "mlp.up_proj.weight",
         "mlp.W_d.weight": "mlp.down_proj.weight"}


def split_qkv(fused: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's ``linear_qkv`` weight [(heads + 2 groups) head_dim, d] or bias as (q, k, v)."""
    head_dim = fused.shape[0] // (heads + 2 * groups)
    per_group = fused.view(groups, (heads // groups + 2) * head_dim, *fused.shape[1:])
    q, k, v = per_group.split([heads // groups * head_dim, head_dim, head_dim], dim=1)
    return tuple(part.reshape(-1, *fused.shape[1:]) for part in (q, k, v))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """The inverse of ``split_qkv``."""
    rest = q.shape[1:]
    per = [t.view(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(per, dim=1).reshape(-1, *rest)


def split_fc1(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's ``linear_fc1`` [gate; up] as (gate, up)."""
    gate, up = fused.chunk(2, dim=0)
    return gate, up


def to_megatron(name: str, read: Callable[[str], torch.Tensor], heads: int, groups: int, vocab_size: int,
                tied: bool) -> Optional[torch.Tensor]:
    """The single-process weight ``name`` from a HF model's tensors (``read``: one by HF name), None for a STEM
    table. The vocabulary padded to ``vocab_size`` with zero rows (their logits 0); a tied ``lm_head`` is
    ``embed_tokens``."""
    if name in TOP:
        tensor = read(TOP["embedding.word_embeddings.weight"] if tied and name == "output_layer.weight"
                      else TOP[name])
        if name != "decoder.final_layernorm.weight" and tensor.shape[0] < vocab_size:
            tensor = torch.cat([tensor, tensor.new_zeros(vocab_size - tensor.shape[0], tensor.shape[1])])
        return tensor
    layer, rest = LAYER.match(name).groups()
    prefix = f"model.layers.{layer}."
    if rest in PLAIN:
        return read(prefix + PLAIN[rest])
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        return fuse_qkv(*(read(f"{prefix}self_attn.{p}_proj.{kind}") for p in "qkv"), heads, groups)
    if rest == "mlp.linear_fc1.weight":
        return torch.cat([read(prefix + "mlp.gate_proj.weight"), read(prefix + "mlp.up_proj.weight")])
    if rest == "mlp.U_l.weight":
        return None
    raise KeyError(f"{name}: no Hugging Face Llama/Qwen2 weight maps to it")
