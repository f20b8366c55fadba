"""The STEM layer's one-function product over compact rows (``model/stem_rows.py``) against the path it replaces:
``F.silu(g) * F.embedding(index, rows).to(g.dtype)`` and autograd."""

import pytest
import torch
import torch.nn.functional as F

from stem_megatron.model import stem_rows
from stem_megatron.model.stem_rows import RowOrder, silu_times_rows

S, B, U, COLS = 48, 3, 40, 24


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, U, (S, B), generator=g)
    index[:U // 2, 0] = torch.arange(U // 2)  # every row read at least once, most several times
    rows = torch.randn(U, COLS, generator=g)
    gate, dh = (torch.randn(S, B, COLS, generator=g).to(dtype) for _ in range(2))
    return gate, rows, index, dh


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_product_and_its_gradients_are_bitwise_those_of_the_gather_path(dtype):
    """On CPU the function runs the same kernels as the path it replaces, in the same order: the output, the
    gate's gradient and the fp32 rows' gradient (summed per row over the sorted order) are the same bits, for an
    fp32 model and for a bf16 one with fp32 rows (the GPU's precisions)."""
    gate, rows, index, dh = _inputs(dtype)
    outs = {}
    for name in ("gather", "function"):
        g, r = gate.clone().requires_grad_(), rows.clone().requires_grad_()
        if name == "gather":
            h = F.silu(g) * F.embedding(index, r).to(dtype)
        else:
            h = silu_times_rows(g, r, index, RowOrder.of(index, U))
        h.backward(dh)
        outs[name] = (h, g.grad, r.grad)
    for got, expected in zip(outs["function"], outs["gather"]):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert outs["function"][2].dtype == torch.float32


def test_rows_order_sorts_the_tokens_by_row_stably():
    index = torch.tensor([[2, 0], [2, 1], [0, 2]])  # [s, b]
    order = RowOrder.of(index, rows=4)
    assert order.perm.tolist() == [1, 4, 3, 0, 2, 5] and order.lengths.tolist() == [2, 1, 3, 0]


@pytest.mark.slow
def test_the_compiled_passes_agree_with_the_eager_ones_within_rounding():
    """On GPU both passes are compiled (megatron's ``jit_fuser``: ``torch.compile``), which fuses the gather and
    evaluates SiLU and its derivative its own way, rounding once where the eager kernels round each step. The
    bound: each value within two units in the last place (of the dtype) of its terms' scale: ``|silu(g)·r|`` for
    the product, ``|dh·r|`` for the gate's gradient (|SiLU'| < 1.1; near SiLU's minimum the derivative cancels, so
    the value itself can be far smaller), ``|dh·silu(g)|`` for a token's row gradient. Compiled here for the CPU,
    the same graphs."""
    for dtype, eps in ((torch.bfloat16, 2.0**-7), (torch.float32, 2.0**-23)):
        gate, rows, index, dh = _inputs(dtype, seed=1)
        rows = rows.to(dtype)
        g, r, d = gate.float(), F.embedding(index, rows).float(), dh.float()
        scales = ((F.silu(g) * r).abs(), (d * r).abs(), (d * F.silu(g)).abs())
        fused = (stem_rows._fused_forward(gate, rows, index), *stem_rows._fused_backward(dh, gate, rows, index))
        eager = (stem_rows._forward(gate, rows, index), *stem_rows._backward(dh, gate, rows, index))
        for name, f, e, scale in zip(("product", "gate gradient", "row gradient"), fused, eager, scales):
            ulp = eps * torch.exp2(torch.floor(torch.log2(scale.clamp(min=1e-30))))
            assert ((f.float() - e.float()).abs() <= 2 * ulp).all(), (dtype, name)
