"""The lean row update (docs/lean_tables.md): the C++ kernel (``rows``) and the torch definition (``fused``) bit for
bit on CPU, both against an fp64 AdamW, the hash, the stochastic rounding, lazy and dense, token ids and TP blocks."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import pytest
import torch

from stem_megatron.host_tables import lean_adam, row_optimizer
from stem_megatron.host_tables.row_optimizer import RowAdam, RowOptimizer, lean_kernel
from stem_megatron.host_tables.row_state import RowState, StateSpec

BETAS, EPS, WD = (0.9, 0.95), 1e-8, 0.1
CPU = torch.device("cpu")
LEAN = [StateSpec(*s) for s in itertools.product(("fp32", "bf16"), ("element", "row"), ("fp32", "bf16"))][1:]


@pytest.fixture(scope="module")
def adam():
    return RowAdam(BETAS, EPS, WD)  # builds both ops once (cached in TORCH_EXTENSIONS_DIR)


def state(spec: StateSpec, rows: int, cols: int, seed: int = 0) -> RowState:
    """Rows with trained-looking values in the spec's dtypes."""
    g = torch.Generator().manual_seed(seed)
    s = RowState.zeros([1], rows, cols, CPU, spec)
    s.master[1].copy_(torch.randn(rows, cols, generator=g) * 0.02)
    s.exp_avg[1].copy_(torch.randn(rows, cols, generator=g) * 1e-3)
    s.exp_avg_sq[1].copy_(torch.rand(rows, s.exp_avg_sq[1].shape[1], generator=g) * 1e-6)
    return s


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def same(a: RowState, b: RowState) -> bool:
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(a.of(1), b.of(1)))


def ref_mix32(x: int) -> int:
    """lowbias32 with plain unsigned products (Python ints), independent of ``lean_adam``'s split multiply."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash_equal_in_cpp_torch_and_plain_python():
    tokens = torch.tensor([0, 1, 5, 129_279, 2**31 + 7, 2**32 - 1])
    cpp = lean_kernel().rounding_bits(12345, 77, 3, 4096, tokens, 40)
    torch_bits = lean_adam.rounding_bits(12345, 77, 3, tokens, 4096, 40)
    assert torch.equal(cpp, torch_bits)
    key = ref_mix32(ref_mix32(ref_mix32(ref_mix32(12345) ^ 77) ^ 3) ^ (2**31 + 7))
    assert cpp[4].tolist() == [ref_mix32((key + 4096 + c) & 0xFFFFFFFF) for c in range(40)]
    assert cpp.unique().numel() == cpp.numel()  # distinct (row, column) draw distinct bits here


@pytest.mark.parametrize("spec", LEAN, ids=lambda s: f"{s.state_dtype}-{s.second_moment}-{s.master_dtype}")
def test_kernel_equals_torch_definition_bitwise(adam, spec):
    """Three steps of dense Adam (touched rows with gradients in their own order, the rest decayed), a TP block's
    col0 and token ids that are not the positions: the C++ kernel and the torch definition give the same bits. 300
    columns: the row sum's fold has odd levels, the kernel's column blocks (128) and vector loops tails."""
    rows, cols = 40, 300
    ids = torch.tensor([1, 2, 3, 7, 20, 39])
    untouched = torch.tensor([i for i in range(rows) if i not in ids.tolist()])
    order = torch.tensor([3, 0, 5, 1, 4, 2])  # the gradient of ids[i] is grads[order[i]]
    token_ids = lambda r: r * 31 + 1000  # noqa: E731
    host, device = state(spec, rows, cols), state(spec, rows, cols)
    opts = [RowOptimizer(adam, kernel, CPU, dense=True, spec=spec, seed=7, col0=300, token_ids=token_ids)
            for kernel in ("rows", "fused")]
    g = torch.Generator().manual_seed(3)
    for step, lr in ((1, 1e-3), (2, 5e-4), (5, 2e-3)):
        grads = torch.randn(ids.numel(), cols, generator=g) * 1e-2
        for opt, s in zip(opts, (host, device)):
            opt.update(step, lr, s, 1, ids, grads, grad_rows=order, untouched=untouched)
    assert same(host, device)
    assert not same(host, state(spec, rows, cols))


def test_row_blocks_equal_torch_bitwise():
    """A row-wise second moment kept per column block (``[rows, blocks]``), as a TP-independent layout would."""
    spec, rows, cols, blocks = StateSpec("bf16", "row", "bf16"), 8, 64, 4
    a = state(spec, rows, cols)
    a.exp_avg_sq[1] = torch.rand(rows, blocks, generator=torch.Generator().manual_seed(1)) * 1e-6
    ids, grads = torch.tensor([0, 3, 5]), torch.randn(3, cols, generator=torch.Generator().manual_seed(2))
    constants = lean_adam.scalars(4, 1e-3, BETAS, EPS, WD)
    want = lean_adam.update(constants, 1, 4, 1, 0, ids, grads, *(t[ids] for t in a.of(1)))
    lean_kernel().lean_adam_rows(constants, 1, 4, 1, 0, ids, None, grads, None, *a.of(1))
    assert all(torch.equal(bits(t[ids]), bits(w)) for t, w in zip(a.of(1), want))


def adamw_fp64(step, lr, p, m, v, g, row):
    """AdamW in fp64 from the same (rounded) state: the definition's meaning, independent of its op order."""
    p, m, v, g = (t.double() for t in (p, m, v, g))
    m = BETAS[0] * m + (1 - BETAS[0]) * g
    v = BETAS[1] * v + (1 - BETAS[1]) * ((g * g).mean(1, keepdim=True) if row else g * g)
    update = (m / (1 - BETAS[0] ** step)) / ((v / (1 - BETAS[1] ** step)).sqrt() + EPS)
    return p * (1 - lr * WD) - lr * update, m, v


@pytest.mark.parametrize("spec", [StateSpec("fp32", "row", "fp32"), StateSpec("bf16", "row", "bf16"),
                                  StateSpec("bf16", "element", "bf16")], ids=["row", "lean", "bf16-element"])
def test_kernel_against_fp64_adamw(adam, spec):
    """fp32 results within 1e-5 relative (of the step) of fp64 AdamW; bf16 ones within one bf16 ulp of it (a
    stochastic rounding goes to a neighbour)."""
    rows, cols, step, lr = 16, 256, 3, 1e-2
    s, ids = state(spec, rows, cols), torch.arange(rows)
    grads = torch.randn(rows, cols, generator=torch.Generator().manual_seed(5)) * 1e-3
    want = adamw_fp64(step, lr, *s.of(1), grads, spec.second_moment == "row")
    before = s.master[1].double()
    RowOptimizer(adam, "rows", CPU, spec=spec).update(step, lr, s, 1, ids, grads)
    for got, ref in zip(s.of(1), want):
        if got.dtype == torch.bfloat16:
            ulp = torch.pow(2.0, torch.floor(torch.log2(ref.abs())) - 7)
            assert ((got.double() - ref).abs() <= ulp * (1 + 1e-6)).all()
        else:
            scale = (ref - before).abs().max() if got is s.master[1] else ref.abs().max()
            assert ((got.double() - ref).abs() <= 1e-5 * scale).all()


def test_stochastic_rounding_unbiased_and_deterministic(adam):
    """exp_avg in bf16 from zero with one gradient value: (1 - beta1) g lies between two bf16 values; over 8,192
    columns the stored values average to it (within 4 standard errors), each one of its two neighbours. The same
    inputs give the same bits; another step other bits."""
    spec, cols = StateSpec("bf16", "row", "fp32"), 8192
    g_value = 1.2345e-3
    exact = lean_adam._fp32(lean_adam._fp32(g_value) * lean_adam._fp32(1 - BETAS[0]))

    def run(step):
        s = RowState.zeros([1], 1, cols, CPU, spec)
        RowOptimizer(adam, "rows", CPU, spec=spec, seed=11).update(step, 1e-3, s, 1, torch.tensor([0]),
                                                                      torch.full((1, cols), g_value))
        return s.exp_avg[1][0]

    m = run(1)
    low = torch.tensor(exact).bfloat16().float()
    low = low if low <= exact else torch.nextafter(low.bfloat16(), torch.tensor(0.0).bfloat16()).float()
    high = torch.nextafter(low.bfloat16(), torch.tensor(1.0).bfloat16()).float()
    assert set(m.float().unique().tolist()) == {low.item(), high.item()}
    p_up = (exact - low.item()) / (high.item() - low.item())
    stderr = (high.item() - low.item()) * math.sqrt(p_up * (1 - p_up) / cols)
    assert abs(m.double().mean().item() - exact) < 4 * stderr
    assert abs(m.double().mean().item() - exact) < 0.1 * abs(exact - torch.tensor(exact).bfloat16().item())
    assert torch.equal(bits(run(1)), bits(m))
    assert not torch.equal(bits(run(2)), bits(m))


def test_lazy_keeps_untouched_bits_and_dense_decay_equals_zero_gradients(adam):
    spec, rows, cols = StateSpec("bf16", "row", "bf16"), 12, 64
    ids, grads = torch.tensor([2, 5, 6]), torch.randn(3, cols, generator=torch.Generator().manual_seed(4))
    rest = torch.tensor([i for i in range(rows) if i not in (2, 5, 6)])
    lazy, dense, zeros, before = (state(spec, rows, cols) for _ in range(4))
    RowOptimizer(adam, "rows", CPU, spec=spec).update(3, 1e-3, lazy, 1, ids, grads)
    for t, b in zip(lazy.of(1), before.of(1)):
        assert torch.equal(bits(t[rest]), bits(b[rest]))
        assert not torch.equal(bits(t[ids]), bits(b[ids]))
    RowOptimizer(adam, "rows", CPU, dense=True, spec=spec).update(3, 1e-3, dense, 1, ids, grads, untouched=rest)
    every, full = torch.arange(rows), torch.zeros(rows, cols)
    full[ids] = grads
    RowOptimizer(adam, "rows", CPU, spec=spec).update(3, 1e-3, zeros, 1, every, full)
    assert same(dense, zeros)
    assert all(not torch.equal(bits(t[rest]), bits(b[rest])) for t, b in zip(dense.of(1), before.of(1)))


def columns(s: RowState, lo: int, hi: int) -> RowState:
    return RowState(*({1: t[:, lo:hi].clone()} for t in s.of(1)))


def test_rounding_follows_token_ids_and_global_columns(adam):
    """The same tokens stored at other positions, or split into two TP column blocks, round alike."""
    spec, rows, cols = StateSpec("bf16", "element", "bf16"), 10, 64
    ids, grads = torch.tensor([1, 4, 8]), torch.randn(3, cols, generator=torch.Generator().manual_seed(6))
    by_token = state(spec, rows, cols)
    perm = torch.tensor([9, 3, 0, 7, 1, 5, 2, 8, 6, 4])  # position i holds token perm[i]
    inv = perm.argsort()  # token t is at position inv[t]
    moved = RowState(*({1: t[perm].clone()} for t in by_token.of(1)))
    RowOptimizer(adam, "rows", CPU, spec=spec).update(2, 1e-3, by_token, 1, ids, grads)
    at, order = inv[ids].sort()
    RowOptimizer(adam, "rows", CPU, spec=spec, token_ids=lambda r: perm[r]).update(2, 1e-3, moved, 1, at, grads,
                                                                                  grad_rows=order)
    assert same(by_token, RowState(*({1: t[inv]} for t in moved.of(1))))

    whole = state(spec, rows, cols)
    half = cols // 2
    blocks = [columns(whole, 0, half), columns(whole, half, cols)]
    RowOptimizer(adam, "rows", CPU, spec=spec).update(2, 1e-3, whole, 1, ids, grads)
    for k, block in enumerate(blocks):
        RowOptimizer(adam, "rows", CPU, spec=spec, col0=k * half).update(
            2, 1e-3, block, 1, ids, grads[:, k * half:(k + 1) * half].contiguous())
        assert same(columns(whole, k * half, (k + 1) * half), block)


def test_bad_settings_and_tensors_say_what_is_wrong(adam):
    with pytest.raises(ValueError, match="host_tables.second_moment must be one of element, row, got 'column'"):
        StateSpec(second_moment="column")
    s = state(StateSpec("bf16", "row", "bf16"), 4, 64)
    s.exp_avg_sq[1] = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="row-wise exp_avg_sq must be float32 .* blocks dividing the columns"):
        RowOptimizer(adam, "rows", CPU, spec=StateSpec("bf16", "row", "bf16")).update(
            1, 1e-3, s, 1, torch.tensor([0]), torch.zeros(1, 64))


def test_a_copy_of_the_tree_builds_its_ops_apart(monkeypatch, tmp_path):
    """A copy of the tree run with this venv (an old commit's, to compare) builds in a directory of its own: ninja's
    command names the source's path, so a shared directory would be rebuilt by the checkout and the copy in turn."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    monkeypatch.setattr(CPUAdamBuilder, "load", lambda self: self.name)  # the build directory's name, no build
    here = row_optimizer._kernel()
    assert row_optimizer._kernel() == here and here.startswith("stem_row_adam_")
    assert row_optimizer._kernel(source=tmp_path / "csrc" / "row_adam.cpp") != here


def test_benchmark_at_its_smallest(capsys):
    """benchmarks/lean_update.py prints every setting with its bytes, fp32's ratio 1.00x."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import lean_update

    lean_update.main(["--rows", "256", "--cols", "64", "--tokens", "512", "--repeats", "1"])
    out = capsys.readouterr().out
    assert all(name in out for name in lean_update.SETTINGS)
    assert f"{'fp32':27} {12:8.2f} |" in out and " 28.00 " in out and " 1.00x" in out
