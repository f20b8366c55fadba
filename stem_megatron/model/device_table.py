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
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import divide

from stem_megatron.model.token_context import MicroBatchTokens

_INIT_ROWS = 4096  # rows drawn per generator seed


def table_row_chunks(seed: int, layer: int, vocab_size: int, d_ff: int, std: float):
    """``U_l``'s rows by token id as (first id, rows) chunks of 4096, each from a generator seeded by
    (seed, layer, first id): the same table on both placements (device parameter, host store), every
    node and every TP size."""
    for start in range(0, vocab_size, _INIT_ROWS):
        g = torch.Generator().manual_seed(seed * 1_000_003 + layer * 7919 + start)
        yield start, torch.randn(min(_INIT_ROWS, vocab_size - start), d_ff, generator=g) * std


def table_init_std(config: TransformerConfig, vocab_size: int, table_init: str = "scaled",
                   std: float | None = None) -> float:
    """The std of ``U_l ~ N(0, std)``: ``std`` if given, else by ``stem.table_init`` (docs/recipes.md):
    ``scaled``: init_method_std * sqrt(d), the scale of the ``W_u x`` entries ``U_l[t]`` replaces;
    ``xavier``: sqrt(2 / (V + d_ff)), ``xavier_normal_`` of the V x d_ff table, as the released code does
    (``ParallelEmbedding`` in lingua/stem_dist_utils.py); ``from_dense`` draws as ``scaled``, and an import from a
    dense model then overwrites the tables (``checkpoint.hf.load``)."""
    if std is not None:
        return std
    if table_init in ("scaled", "from_dense"):  # from_dense: the draw the calibration overwrites (checkpoint/hf)
        return config.init_method_std * math.sqrt(config.hidden_size)
    if table_init == "xavier":
        return math.sqrt(2 / (vocab_size + config.ffn_hidden_size))
    raise ValueError(f"stem.table_init must be 'scaled' or 'xavier', got {table_init!r}")


class DeviceRowTable(MegatronModule):
    """``U_l`` (V x d_ff) as a device parameter holding this TP rank's column slice, drawn once its layer
    number is known (``set_layer_number``)."""

    def __init__(self, config: TransformerConfig, vocab_size: int, table_init: str = "scaled",
                 init_std: float | None = None, seed: int = 0):
        super().__init__(config=config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.vocab_size, self.seed = vocab_size, seed
        self.std = table_init_std(config, vocab_size, table_init, init_std)
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.empty(vocab_size, divide(config.ffn_hidden_size, tp), dtype=config.params_dtype, device=device)
        )
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=1, stride=1)

    @torch.no_grad()
    def set_layer_number(self, layer_number: int) -> None:
        """Draws the table (megatron's ``TransformerLayer`` calls this right after building the MLP) from
        ``table_row_chunks``, as the host store does; this rank keeps its column slice."""
        if self.weight.is_meta:  # parameter counting
            return
        d_ff, cols = self.config.ffn_hidden_size, self.weight.shape[1]
        first = parallel_state.get_tensor_model_parallel_rank() * cols
        for start, rows in table_row_chunks(self.seed, layer_number, self.vocab_size, d_ff, self.std):
            self.weight[start:start + rows.shape[0]] = rows[:, first:first + cols]

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Checkpoint ``weight`` as TP-sharded along d_ff (dim 1); megatron's default would treat it
        as replicated over TP."""
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 1}, sharded_offsets)

    def forward(self, tokens: MicroBatchTokens) -> torch.Tensor:
        """The rows of ``tokens.ids`` [b, s] as [s, b, d_ff/tp]."""
        return F.embedding(tokens.ids.t(), self.weight)
