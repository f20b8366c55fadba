"""The on-device row source: where a STEM layer gets ``U_l[t]`` for its tokens.

A STEM layer only calls ``row_source(tokens) -> rows`` (``token_context.MicroBatchTokens``); which
module answers is chosen by the layer spec. ``DeviceRowTable`` keeps ``U_l`` as an ordinary parameter
on the compute device, sharded by columns like the gate: TP rank r holds ``U_l[:, r*d_ff/tp:(r+1)*d_ff/tp]``,
the same slice of d_ff its ``W_g`` shard produces, so no TP communication is added. The host-resident
store supplies a module with the same call signature (``host_tables/row_source.py``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import (
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import divide

from stem_megatron.model.token_context import MicroBatchTokens


def table_init_method(config: TransformerConfig, std: float | None):
    """N(0, std) init; default std matches the entries of the ``W_u x`` that ``U_l[t]`` replaces."""
    std = config.init_method_std * math.sqrt(config.hidden_size) if std is None else std
    return lambda w: torch.nn.init.normal_(w, mean=0.0, std=std)


class DeviceRowTable(MegatronModule):
    """``U_l`` (V x d_ff) as a device parameter holding this TP rank's column slice."""

    def __init__(self, config: TransformerConfig, vocab_size: int, init_std: float | None = None):
        super().__init__(config=config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        d_ff = config.ffn_hidden_size
        self.vocab_size = vocab_size
        shape = (vocab_size, divide(d_ff, tp))
        init = table_init_method(config, init_std)
        # Same placement and init path as megatron's ColumnParallelLinear (TP-invariant on CPU).
        if config.use_cpu_initialization:
            self.weight = torch.nn.Parameter(torch.empty(*shape, dtype=config.params_dtype))
            _initialize_affine_weight_cpu(
                self.weight, vocab_size, d_ff, shape[1], 1, init, params_dtype=config.params_dtype
            )
        else:
            self.weight = torch.nn.Parameter(
                torch.empty(*shape, dtype=config.params_dtype, device=torch.cuda.current_device())
            )
            _initialize_affine_weight_gpu(self.weight, init, partition_dim=1)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Checkpoint ``weight`` as TP-sharded along d_ff (dim 1); megatron's default would treat it
        as replicated over TP."""
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 1}, sharded_offsets)

    def forward(self, tokens: MicroBatchTokens) -> torch.Tensor:
        """The rows of ``tokens.ids`` [b, s] as [s, b, d_ff/tp]."""
        return F.embedding(tokens.ids.t(), self.weight)
