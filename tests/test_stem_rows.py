"""The STEM layer's one-function product over compact rows (``model/stem_rows.py``) against the path it replaces:
``F.silu(g) * F.embedding(index, rows).to(g.dtype)`` and autograd."""

import pytest
import torch
import torch.nn.functional as F

from stem_megatron.model import stem_rows
from stem_megatron.model.stem_rows import RowOrder, silu_times_rows

S, B, U, COLS = 48, 3, 40, 24


def _inputs(dtype, seed=0, s=S, b=B, u=U):
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, u, (s, b), generator=g)
    index[:u // 2, 0] = torch.arange(u // 2)  # every row read at least once, most several times
    rows = torch.randn(u, COLS, generator=g)
    gate, dh = (torch.randn(s, b, COLS, generator=g).to(dtype) for _ in range(2))
    return gate, rows, index, dh


def _ulp(scale, eps):
    """A unit in the last place (of the dtype of epsilon ``eps``) of ``scale``."""
    return eps * torch.exp2(torch.floor(torch.log2(scale.clamp(min=1e-30))))


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
            assert ((f.float() - e.float()).abs() <= 2 * _ulp(scale, eps)).all(), (dtype, name)


def _layer(gate, rows, index, dh):
    """The function's output and gradients at these inputs; without grad mode (validation), the output only, of
    inputs that do not require grad, as validation's gate and rows do not."""
    g, r = (t.clone().requires_grad_(torch.is_grad_enabled()) for t in (gate, rows))
    h = silu_times_rows(g, r, index)
    if not torch.is_grad_enabled():
        return (h,)
    h.backward(dh)
    return h, g.grad, r.grad


@pytest.mark.slow
def test_the_compiled_passes_compile_once_for_every_row_and_token_count_and_for_no_grad(monkeypatch):
    """Training changes the row count ``u`` every step and the token count at validation, which calls the layer
    without grad: each compiled pass (CPU inductor here, the same graphs as on GPU) compiles once a process,
    dynamic in tokens and rows from the first call (rather than 4 forward graphs and 3 backward ones). Each
    call within rounding of the eager function: the output and the gate's gradient as above, a row's gradient
    within its tokens' bounds plus the two fp32 sums' rounding (tokens x eps x the sum of their scales each)."""
    codes = stem_rows._forward.__code__, stem_rows._backward.__code__
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    eps = 2.0**-23
    for seed, (s, b, u, grad) in enumerate(((48, 3, 40, True), (40, 3, 33, True), (56, 2, 47, True),
                                            (36, 2, 29, False))):
        gate, rows, index, dh = _inputs(torch.float32, seed, s, b, u)
        with torch.set_grad_enabled(grad):
            eager = _layer(gate, rows, index, dh)
            with monkeypatch.context() as m:  # the compiled passes where the function runs (the CPU)
                m.setattr(stem_rows, "_forward", stem_rows._fused_forward)
                m.setattr(stem_rows, "_backward", stem_rows._fused_backward)
                fused = _layer(gate, rows, index, dh)
        g, r, d = gate, F.embedding(index, rows), dh
        token_row = (d * F.silu(g)).abs().reshape(-1, COLS)
        order = RowOrder.of(index, u)
        per_row = [torch.zeros(u, COLS).index_add_(0, index.reshape(-1), x) for x in (2 * _ulp(token_row, eps),
                                                                                        token_row)]
        bounds = (2 * _ulp((F.silu(g) * r).abs(), eps), 2 * _ulp((d * r).abs(), eps),
                  per_row[0] + 2 * order.lengths[:, None] * eps * per_row[1])
        for name, f, e, bound in zip(("product", "gate gradient", "row gradient"), fused, eager, bounds):
            assert f.shape == e.shape and ((f - e).abs() <= bound).all(), (seed, name)
        assert len(fused) == (3 if grad else 1) and fused[0].requires_grad == grad
    assert [len(torch._dynamo.eval_frame._debug_get_cache_entry_list(c)) for c in codes] == [1, 1]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 2
