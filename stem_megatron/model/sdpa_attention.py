"""megatron-core core attention on torch's ``scaled_dot_product_attention``.

megatron's local ``DotProductAttention``, the ``core_attention`` of its non-TE layer spec (every CPU run, and a GPU
without Transformer Engine), materialises the ``[b, n, s, s]`` scores and probabilities of every layer: ~70% of a
350M model's CUDA time and 70 GiB at micro-batch 4 x 2048 on an H100. SDPA runs flash / memory-efficient kernels
on a GPU, which never store them. ``SDPAttention`` takes ``DotProductAttention``'s place in a layer spec (same
constructor and forward, same layouts, the same heads on each TP rank) and equals it in fp32
(``tests/test_sdpa_attention.py``).

What ``DotProductAttention`` runs and this module does not is refused, at construction or forward: context
parallelism, a softmax offset (``softmax_type`` other than ``vanilla``), sliding windows, an attention bias,
packed sequences (THD), a causal mask over unequal query and key lengths. One difference remains: a query whose
keys are all masked gets zeros here, the mean of the values there (megatron fills masked scores with -10000);
no data path makes such a row (the diagonal of a causal, per-document mask is always kept).
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide


def _kernel_takes_grouped_kv(query: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> bool:
    """Whether SDPA gets the K/V heads grouped (``enable_gqa``) rather than repeated to the query heads.

    Only where torch's CUDA flash kernel runs (fp16/bf16, no mask tensor), which takes grouped K/V. Whether the other
    fused kernels do depends on the torch build (the memory-efficient one, the GPU kernel for a mask or fp32, did not
    in older releases), and where none does SDPA runs its math kernel, which materialises the scores: there K/V are
    repeated as megatron does, one copy of them.
    """
    return attn_mask is None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)


class SDPAttention(MegatronModule):
    """Core attention (the ``core_attention`` slot of megatron's ``SelfAttentionSubmodules``) computed by SDPA.

    Arguments as ``DotProductAttention``'s. ``apply_query_key_layer_scaling`` needs nothing here: megatron divides
    its scale by the layer number and its softmax multiplies it back (an fp16 overflow guard); SDPA's kernels
    accumulate in fp32, so the scale is applied once, unchanged.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        unsupported = [
            (config.context_parallel_size != 1, f"context parallelism (size {config.context_parallel_size})"),
            (config.softmax_type != "vanilla", f"softmax_type={config.softmax_type!r} (a softmax offset)"),
            (is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number),
             f"sliding-window attention (window_size={config.window_size})"),
        ]
        for refused, what in unsupported:
            if refused:
                raise NotImplementedError(f"SDPAttention (megatron's local attention path) does not support {what}: "
                                          "use Transformer Engine's attention (a GPU with TE)")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        # per TP rank, as DotProductAttention splits them (Attention has already made num_query_groups >= TP size)
        tp = self.tp_group.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, tp)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)
        self.softmax_scale = (1.0 / math.sqrt(self.hidden_size_per_attention_head)
                              if softmax_scale is None else softmax_scale)
        self.attention_dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        """query ``[sq, b, np, hn]``, key and value ``[sk, b, ng, hn]`` (this TP rank's heads) -> ``[sq, b, np*hn]``.

        Masking as in ``DotProductAttention``'s torch softmax (its fp32 path): a given ``attention_mask`` (bool,
        True = masked out, broadcast to ``[b, np, sq, sk]``) whatever the mask type; else causal for
        ``AttnMaskType.causal`` (SDPA's ``is_causal``, no mask tensor, so flash kernels apply), none for a single
        query (decoding with a KV cache); else none. ``attn_mask_type`` is ignored, as there.
        """
        if packed_seq_params is not None:
            raise NotImplementedError("SDPAttention does not support packed sequences (THD): use TE's attention")
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention does not support an attention bias")
        sq, sk = query.size(0), key.size(0)
        attn_mask, is_causal = None, False
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise TypeError(f"attention_mask must be bool (True = masked out), got {attention_mask.dtype}")
            attn_mask = ~attention_mask  # SDPA's bool mask: True = attends
        elif self.attn_mask_type == AttnMaskType.causal and sq > 1:
            if sq != sk:
                raise ValueError(f"causal attention needs as many queries as keys, got {sq} and {sk}")
            is_causal = True

        repeats = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        grouped = repeats > 1 and _kernel_takes_grouped_kv(query, attn_mask)
        if repeats > 1 and not grouped:
            key = key.repeat_interleave(repeats, dim=2)
            value = value.repeat_interleave(repeats, dim=2)
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, hn]

        dropout_p = self.attention_dropout if self.training else 0.0
        # DotProductAttention draws its dropout under the tracker's fork unless the sequence is TP-split
        fork = dropout_p > 0.0 and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
            context = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                     is_causal=is_causal, scale=self.softmax_scale, enable_gqa=grouped)
        # [b, np, sq, hn] -> [sq, b, np*hn]
        return context.permute(2, 0, 1, 3).reshape(sq, context.size(0), self.hidden_size_per_partition)
