"""Stand-ins for the Transformer Engine modules megatron's TE layer specs use, so the GPU spec builds and
runs on a CPU machine without TE.

Each stand-in computes what the TE module computes, with megatron's local modules, and names its
parameters the way TE does: ``TELayerNormColumnParallelLinear`` applies an RMSNorm (weight
``layer_norm_weight``) before its linear, the rest are the local classes. ``install()`` puts them where
megatron's ``TESpecProvider`` and ``get_gpt_decoder_block_spec`` look them up: call it in a spawned test
process (``distributed.run``), whose patched modules die with it.
"""

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.torch_norm import WrappedTorchNorm


class LayerNormColumnParallelLinear(ColumnParallelLinear):
    """TE's ``TELayerNormColumnParallelLinear``: RMSNorm fused in front of a column-parallel linear."""

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.eps = config.layernorm_epsilon
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))

    def forward(self, x, **kwargs):
        return super().forward(F.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps), **kwargs)


class Norm:
    """TE's ``TENorm`` (its signature: megatron-core 0.19's TE provider builds a MoE layer's pre-MLP norm with
    ``has_residual=True``, which only fuses the residual add when the config asks for it; ours does not)."""

    def __new__(cls, config, hidden_size, eps=1e-5, has_residual=False):
        return WrappedTorchNorm(config, hidden_size, eps)


def install() -> None:
    """Make megatron's TE spec provider and decoder block spec hand out the stand-ins (this process)."""
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    from megatron.core.models.gpt import gpt_layer_specs

    for name, cls in (("TEColumnParallelLinear", ColumnParallelLinear), ("TERowParallelLinear", RowParallelLinear),
                      ("TELayerNormColumnParallelLinear", LayerNormColumnParallelLinear),
                      ("TEDotProductAttention", DotProductAttention), ("TENorm", Norm)):
        setattr(provider, name, cls)
    provider.is_te_min_version = lambda version: True  # no TE to ask
    gpt_layer_specs.TESpecProvider = provider.TESpecProvider
    gpt_layer_specs.TENorm = Norm
