"""The row-indexed CPU Adam (``RowAdam.update_rows``, ``update_untouched_rows``) against DeepSpeed's dense update
of the same tables."""

from __future__ import annotations

import pytest
import torch

from stem_megatron.host_tables.row_optimizer import RowAdam

BETAS, EPS, WD = (0.9, 0.95), 1e-8, 0.1


@pytest.fixture(scope="module")
def adam():
    return RowAdam(BETAS, EPS, WD)  # builds the op once (cached in TORCH_EXTENSIONS_DIR)


def tables(vocab, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, cols, generator=g), torch.randn(vocab, cols, generator=g) * 1e-2,
            torch.rand(vocab, cols, generator=g) * 1e-3)


def check_against_dense(adam, vocab, cols, ids, steps):
    """Rows ``ids`` updated by index == DeepSpeed's whole-table update with zero gradients elsewhere;
    the other rows (weights and both moments) keep their bits."""
    lazy = tables(vocab, cols)
    dense = tuple(t.clone() for t in lazy)
    before = tuple(t.clone() for t in lazy)
    untouched = torch.ones(vocab, dtype=torch.bool)
    untouched[ids] = False
    g = torch.Generator().manual_seed(1)
    for step, lr in steps:
        grads = torch.randn(ids.numel(), cols, generator=g)
        adam.update_rows(step, lr, ids, grads, *lazy)
        full = torch.zeros(vocab, cols)
        full[ids] = grads
        p, m, v = dense
        adam.update(step, lr, p, full, m, v)
    for got, want, old in zip(lazy, dense, before):
        assert torch.equal(got[ids], want[ids])
        assert torch.equal(got[untouched], old[untouched])


def test_rows_equal_dense_update_bitwise_over_steps(adam):
    """Changing lr and non-consecutive steps (bias correction by the step, not by how many calls)."""
    ids = torch.sort(torch.randperm(500, generator=torch.Generator().manual_seed(2))[:120]).values
    check_against_dense(adam, 500, 256, ids, [(1, 1e-3), (2, 5e-4), (3, 2e-3), (10, 1e-3), (11, 1e-4)])


def test_rows_at_both_table_ends(adam):
    check_against_dense(adam, 64, 384, torch.tensor([0, 1, 31, 62, 63]), [(1, 1e-3), (2, 1e-3)])


def test_odd_row_width_matches_deepspeed_per_row():
    """A width that is no multiple of the SIMD span takes DeepSpeed's narrower and scalar tail inside each row;
    the dense reference then runs the same code per row (a contiguous row block of one row). Consecutive ids
    (0, 1 and 38, 39) stay separate rows here: as one block their tails would run the vector code."""
    adam = RowAdam(BETAS, EPS, WD)
    vocab, cols = 40, 131
    ids = torch.tensor([0, 1, 5, 17, 38, 39])
    lazy = tables(vocab, cols)
    ref = tuple(t.clone() for t in lazy)
    for step in (1, 2, 3):
        grads = torch.randn(ids.numel(), cols)
        adam.update_rows(step, 1e-3 * step, ids, grads, *lazy)
        for r, row in enumerate(ids.tolist()):
            p, m, v = (t[row:row + 1] for t in ref)
            adam.update(step, 1e-3 * step, p, grads[r:r + 1], m, v)
    for got, want in zip(lazy, ref):
        assert torch.equal(got, want)


@pytest.mark.parametrize("cols", [256, 131])  # whole SIMD spans (consecutive rows merged into blocks), and not
def test_untouched_rows_equal_zero_gradients_bitwise(adam, cols):
    """The dense store's step (touched rows with their gradients, the other owned rows without) == one update of
    every owned row with zero-filled gradients, over steps; rows not owned keep their bits. The untouched runs
    300-599 and 620-699 are cut into blocks at the zero buffer's size (64 rows of 256)."""
    vocab = 700
    owned = torch.cat([torch.arange(0, 600), torch.arange(620, vocab)])
    touched = torch.sort(torch.randperm(300, generator=torch.Generator().manual_seed(3))[:60]).values
    untouched = owned[~torch.isin(owned, touched)]
    split = tables(vocab, cols)
    filled = tuple(t.clone() for t in split)
    before = tuple(t.clone() for t in split)
    g = torch.Generator().manual_seed(4)
    for step, lr in [(1, 1e-3), (2, 5e-4), (5, 2e-3)]:
        grads = torch.randn(touched.numel(), cols, generator=g)
        adam.update_rows(step, lr, touched, grads, *split)
        adam.update_untouched_rows(step, lr, untouched, *split)
        zero_filled = torch.zeros(owned.numel(), cols)
        zero_filled[torch.searchsorted(owned, touched)] = grads
        adam.update_rows(step, lr, owned, zero_filled, *filled)
    for got, want, old in zip(split, filled, before):
        assert torch.equal(got, want)
        assert torch.equal(got[600:620], old[600:620])


UPDATES = {  # both row updates, as the store calls them (gradients of ones)
    "rows": lambda adam, ids, t: adam.update_rows(1, 1e-3, ids, torch.ones(ids.numel(), t[0].size(1)), *t),
    "untouched": lambda adam, ids, t: adam.update_untouched_rows(1, 1e-3, ids, *t),
}


@pytest.mark.parametrize("update", UPDATES.values(), ids=UPDATES.keys())
def test_empty_ids_change_nothing(adam, update):
    lazy = tables(16, 128)
    before = tuple(t.clone() for t in lazy)
    update(adam, torch.empty(0, dtype=torch.int64), lazy)
    for got, old in zip(lazy, before):
        assert torch.equal(got, old)


@pytest.mark.parametrize("update", UPDATES.values(), ids=UPDATES.keys())
@pytest.mark.parametrize("ids, error, message", [
    ([3, 2], ValueError, "sorted and unique"),
    ([2, 2], ValueError, "sorted and unique"),
    ([0, 16], IndexError, "row id 16 out of range for a table of 16 rows"),
    ([-1, 0], IndexError, "row id -1 out of range"),
])
def test_bad_ids_raise_and_leave_tables_alone(adam, update, ids, error, message):
    lazy = tables(16, 128)
    before = tuple(t.clone() for t in lazy)
    with pytest.raises(error, match=message):
        update(adam, torch.tensor(ids), lazy)
    for got, old in zip(lazy, before):
        assert torch.equal(got, old)


def test_mismatched_shapes_raise(adam):
    p, m, v = tables(16, 128)
    with pytest.raises(ValueError, match="grads must be"):
        adam.update_rows(1, 1e-3, torch.tensor([1, 2]), torch.ones(2, 64), p, m, v)
    with pytest.raises(ValueError, match="float32"):
        adam.update_rows(1, 1e-3, torch.tensor([1]), torch.ones(1, 128), p.double(), m, v)
    with pytest.raises(ValueError, match="float32"):
        adam.update_untouched_rows(1, 1e-3, torch.tensor([1]), p, m.double(), v)


@pytest.mark.parametrize("cols", [256, 131])
def test_gradients_found_by_grad_rows_equal_gradients_in_row_order_bitwise(adam, cols):
    """The store leaves a step's gradients where they landed and names each row's (``grad_rows``): the same bits
    as passing ``grads[grad_rows]``, with runs of consecutive rows (merged blocks at 256 columns) whose gradients
    are and are not consecutive too."""
    ids = torch.tensor([3, 4, 5, 6, 9, 10, 20, 21, 22])
    grad_rows = torch.tensor([7, 8, 0, 1, 5, 2, 3, 4, 6])  # 7, 8 and 3, 4 follow each other, the rest do not
    by_index, permuted = tables(30, cols), tables(30, cols)
    g = torch.Generator().manual_seed(3)
    for step in (1, 2):
        grads = torch.randn(9, cols, generator=g)
        adam.update_rows(step, 1e-3, ids, grads, *by_index, grad_rows=grad_rows)
        adam.update_rows(step, 1e-3, ids, grads[grad_rows], *permuted)
    for got, want in zip(by_index, permuted):
        assert torch.equal(got, want)


def test_bad_grad_rows_raise_and_leave_tables_alone(adam):
    lazy = tables(16, 128)
    before = tuple(t.clone() for t in lazy)
    with pytest.raises(IndexError, match=r"grad_rows\[1\] = 4 out of range for 2 gradient rows"):
        adam.update_rows(1, 1e-3, torch.tensor([1, 2]), torch.ones(2, 128), *lazy, grad_rows=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="grad_rows must be"):
        adam.update_rows(1, 1e-3, torch.tensor([1, 2]), torch.ones(2, 128), *lazy, grad_rows=torch.tensor([0]))
    for got, old in zip(lazy, before):
        assert torch.equal(got, old)


def test_flags_are_detected_once_a_kind_of_cpu_and_are_deepspeeds(adam, tmp_path):
    """DeepSpeed's flag detection runs once for this CPU, and what is kept is what it detects (the op built with
    them is found built, not rebuilt); a damaged file is detected anew, another CPU's entry stays."""
    import json

    from deepspeed.ops.op_builder import CPUAdamBuilder

    from stem_megatron.host_tables import row_optimizer as row_adam

    kept = json.loads((row_adam.extensions_root() / "stem_row_adam_cxx_args.json").read_text())
    assert kept[row_adam._cpu_key()] == CPUAdamBuilder().cxx_args()  # the fixture's op loaded with them
    flags, calls = ["-march=native", "-D__AVX256__"], []

    def detect():
        calls.append(1)
        return flags

    path = tmp_path / "stem_row_adam_cxx_args.json"
    path.write_text("{not json")
    assert row_adam.cached_cxx_args(tmp_path, detect) == flags and len(calls) == 1
    assert row_adam.cached_cxx_args(tmp_path, detect) == flags and len(calls) == 1  # not detected again
    other = {"another cpu": ["-mcpu=native"]}
    path.write_text(json.dumps(other))
    assert row_adam.cached_cxx_args(tmp_path, detect) == flags and len(calls) == 2
    assert json.loads(path.read_text()) == {**other, row_adam._cpu_key(): flags}


def test_the_op_is_built_in_the_venv_without_the_makefile(monkeypatch):
    """A script run directly (``tools/gpu_check.py``, ``benchmarks/gpu_step.py``: no Makefile, no SLURM script to
    set ``TORCH_EXTENSIONS_DIR``) finds the op `make setup` built in the venv, not torch's ``~/.cache`` default, where
    it would be rebuilt; a set ``TORCH_EXTENSIONS_DIR`` still wins, and the processes the op's loader starts see it,
    with the venv's ``ninja`` on their PATH."""
    import os
    import sys
    from pathlib import Path

    from stem_megatron.host_tables import row_optimizer as row_adam

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # the venv not activated: its ninja is off PATH
    assert row_adam.extensions_root() == Path(sys.prefix) / "torch_extensions"
    RowAdam((0.9, 0.95), 1e-8, 0.0)
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(Path(sys.prefix) / "torch_extensions")
    assert os.environ["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)  # where torch finds ninja
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/elsewhere")
    assert row_adam.extensions_root() == Path("/elsewhere")
