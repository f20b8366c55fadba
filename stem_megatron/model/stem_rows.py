"""``SiLU(W_g x) ⊙ U_l[t]`` as one autograd function over a micro-batch's compact rows.

A host-resident layer gets its micro-batch's rows compact: one row per distinct id (``[u, d_ff/tp]``, an fp32
leaf whose gradient the store collects) and each token's position among them (``index``, ``[s, b]``). Gathering
them to tokens first, as ``F.embedding`` does, writes an fp32 ``[s, b, d_ff/tp]`` tensor and a compute-dtype copy,
keeps both for backward, and re-sorts the index in every layer's backward. Here:

- forward gathers the rows in the compute dtype inside the product (``silu(g) * rows[index]``) and keeps only
  ``g``, the compact rows and the index;
- backward recomputes the gathered rows and ``silu(g)`` inside the gradient's own pass and sums each row's token
  gradients in fp32 over the order the prefetcher sorted once per micro-batch (``order``: the tokens by row, and
  the tokens per row), a segmented sum: deterministic, and no sort on the device.

On GPU the two elementwise passes are compiled with megatron-core's ``jit_fuser`` (``torch.compile``, as its fused
SwiGLU), which fuses the gather into them, once a process: they see the tokens flattened (``[s*b, cols]``) and
that dimension and the row count dynamic from the first call, since both change from step to step, and no
``requires_grad``, which training and validation's no-grad call would otherwise guard apart. On CPU they run as
torch's eager kernels, the same ones an ``F.embedding`` of the expanded rows runs, so the values are bitwise
those of that path (``tests/test_stem_rows.py``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from megatron.core.jit import jit_fuser


class RowOrder(NamedTuple):
    """A micro-batch's tokens (in the layer's ``[s, b]`` order, flattened) sorted by their row, stably, and the
    tokens per row: what the row gradient's segmented sum reads."""

    perm: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def of(cls, index: torch.Tensor, rows: int) -> "RowOrder":
        """The order of ``index`` (``[s, b]``: each token's row among ``rows``), computed where it is (the host)."""
        flat = index.reshape(-1)
        return cls(torch.sort(flat, stable=True).indices, torch.bincount(flat, minlength=rows))


def _forward(g: torch.Tensor, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * F.embedding(index, rows)


def _backward(dh: torch.Tensor, g: torch.Tensor, rows: torch.Tensor, index: torch.Tensor):
    """(the gate's gradient, each token's row gradient), as autograd of ``_forward`` computes them."""
    return torch.ops.aten.silu_backward(dh * F.embedding(index, rows), g), dh * F.silu(g)


def _compiled(fn):
    """``fn`` through ``jit_fuser``, compiled for any length of its arguments' first dimension (tokens or rows),
    on detached arguments: dynamo would otherwise specialize on the first call's shapes and ``requires_grad``,
    then recompile on the next step's row count and on validation's no-grad call (10-40 s a process on GPU)."""
    compiled = jit_fuser(fn)

    def call(*tensors):
        tensors = [t.detach() for t in tensors]  # new tensors: the marks stay off the caller's
        for t in tensors:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return compiled(*tensors)

    return call


_fused_forward, _fused_backward = _compiled(_forward), _compiled(_backward)


class _SiLUTimesRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, rows, index, perm, lengths):
        compact = rows.to(g.dtype)  # [u, cols]: cast before the gather, so tokens never hold fp32 rows
        ctx.save_for_backward(g, compact, index, perm, lengths)
        ctx.rows_dtype = rows.dtype
        h = (_fused_forward if g.is_cuda else _forward)(_tokens(g), compact, index.reshape(-1))
        return h.view(g.shape)

    @staticmethod
    def backward(ctx, dh):
        g, compact, index, perm, lengths = ctx.saved_tensors
        dg, d_tokens = (_fused_backward if g.is_cuda else _backward)(_tokens(dh.contiguous()), _tokens(g), compact,
                                                                     index.reshape(-1))
        d_tokens = d_tokens.float()  # rows' gradients sum in fp32
        # unsafe: lengths come from RowOrder (each >= 1, summing to the tokens); the checks would sync the device
        d_rows = torch.segment_reduce(d_tokens.index_select(0, perm), "sum", lengths=lengths, axis=0, unsafe=True)
        return dg.view(g.shape), d_rows.to(ctx.rows_dtype), None, None, None


def _tokens(t: torch.Tensor) -> torch.Tensor:
    """``[s, b, cols]`` as ``[s*b, cols]`` (a view for the layer's tensors): one token dimension to leave dynamic."""
    return t.reshape(-1, t.shape[-1])


def silu_times_rows(g: torch.Tensor, rows: torch.Tensor, index: torch.Tensor,
                    order: Optional[RowOrder] = None) -> torch.Tensor:
    """``SiLU(g) ⊙ rows[index]``: ``g`` ``[s, b, cols]`` in the compute dtype, ``rows`` ``[u, cols]`` (an fp32 leaf
    gets an fp32 gradient), ``index`` ``[s, b]``; ``order``: ``RowOrder.of(index, u)`` (computed here if None)."""
    if order is None:
        order = RowOrder.of(index, rows.shape[0])
    return _SiLUTimesRows.apply(g, rows, index, order.perm, order.lengths)
