"""The tables' row state settings (``host_tables.state_dtype``, ``second_moment``, ``master_dtype``;
docs/lean_tables.md) as a run takes them: validated in one line, stored by the host record in their dtypes and
shapes, and converted once when a checkpoint of another setting loads (docs/checkpoints.md). The lean update's
exactness across tiers and layouts: tests/test_working_set.py, test_parallel_equivalence.py, test_checkpoint.py."""

import distributed
import pytest
import torch

from stem_megatron.config import ConfigError, HostTablesConfig, RunConfig, validate_layout

V, D_FF = 64, 64
LEAN = dict(state_dtype="bf16", second_moment="row", master_dtype="bf16", read_dtype="bf16")


@pytest.mark.parametrize("fields,line", [
    (dict(master_dtype="bf16"), "host_tables.master_dtype: bf16: the masters are the node's bf16 copy of the table: "
                                "set host_tables.read_dtype=bf16 too, or master_dtype=fp32"),
    (dict(second_moment="column"), "host_tables.second_moment: must be one of element, row, got 'column'"),
    (dict(state_dtype="fp16"), "host_tables.state_dtype: must be one of fp32, bf16, got 'fp16'")])
def test_a_bad_setting_is_refused_in_one_line(fields, line):
    with pytest.raises(ConfigError) as refused:
        validate_layout(RunConfig(host_tables=HostTablesConfig(**fields)), 1)
    assert str(refused.value) == line
    validate_layout(RunConfig(host_tables=HostTablesConfig(**LEAN)), 1)  # the lean recipe's fields pass


class _Member:
    """The checkpoint's view of the tables (``training/table_optimizer.TableOptimizer``'s verbs) over a store."""

    hosted = True

    def __init__(self, store):
        self.store = store

    def sharded_state_dict(self, is_loading=False, kinds=("weight", "exp_avg", "exp_avg_sq")):
        return self.store.sharded_state_dict(kinds, loading=is_loading)

    def load_state_dict(self, state_dict):
        self.store.restore(state_dict.get("steps_done"))


def _store(fields, layers=(1,)):
    from stem_megatron.host_tables.store import HostTableStore, StoreConfig

    return HostTableStore(StoreConfig(layers, V, D_FF, 0.02, seed=5, host=HostTablesConfig(**fields)))


def _state(store):
    return {kind: tensor[1].clone() for kind, tensor in vars(store.record.state).items()}


def _convert_both_ways(directory):
    """An fp32 store with trained-looking state saved, loaded into a lean store, saved, loaded into an fp32 one."""
    import contextlib
    import io

    from stem_megatron.checkpoint import host_tables

    fp32 = _store({})
    g = torch.Generator().manual_seed(0)
    state = fp32.record.state
    state.master[1].copy_(torch.randn(state.master[1].shape, generator=g) * 0.02)
    state.exp_avg[1].copy_(torch.randn(state.exp_avg[1].shape, generator=g) * 1e-3)
    state.exp_avg_sq[1].copy_(torch.rand(state.exp_avg_sq[1].shape, generator=g) * 1e-6)
    saved = _state(fp32)
    host_tables.save(_Member(fp32), fp32.sharded_state_dict(), directory / "fp32")
    lean, said = _store(LEAN), io.StringIO()
    with contextlib.redirect_stderr(said):
        host_tables.load(_Member(lean), directory / "fp32")
    into_lean = {**_state(lean), "table": lean.table(1)}
    host_tables.save(_Member(lean), lean.sharded_state_dict(), directory / "lean")
    back = _store({})
    with contextlib.redirect_stderr(said):
        host_tables.load(_Member(back), directory / "lean")
    return (saved, into_lean, {**_state(back), "table": back.table(1)}, back.record.own.ids_at(torch.arange(V)),
            said.getvalue())


def test_an_fp32_checkpoint_loads_into_lean_state_and_back(tmp_path):
    """fp32 -> lean: masters and ``exp_avg`` rounded to nearest even bf16, the element-wise ``exp_avg_sq`` the mean
    of each block of d_ff / 8 columns; lean -> fp32: bf16 widened, each block's value spread over its columns; the
    node's copy from the masters both times; one line says so."""
    saved, lean, back, ids, err = distributed.run(_convert_both_ways, 1, tmp_path)[0]
    bits = lambda t: t.view(torch.int16)  # noqa: E731
    assert lean["master"].dtype == lean["exp_avg"].dtype == torch.bfloat16 and lean["exp_avg_sq"].shape == (V, 8)
    assert torch.equal(bits(lean["master"]), bits(saved["master"].to(torch.bfloat16)))
    assert torch.equal(bits(lean["exp_avg"]), bits(saved["exp_avg"].to(torch.bfloat16)))
    assert torch.equal(lean["exp_avg_sq"], saved["exp_avg_sq"].view(V, 8, 8).mean(2))
    assert torch.equal(lean["table"][ids], saved["master"].to(torch.bfloat16).float())  # by token id
    assert torch.equal(back["master"], lean["master"].float()) and torch.equal(back["exp_avg"], lean["exp_avg"].float())
    assert torch.equal(back["exp_avg_sq"], lean["exp_avg_sq"].repeat_interleave(8, dim=1))
    assert torch.equal(back["table"], lean["table"])
    assert err.count("converted once") == 2
    assert ("holds state_dtype=fp32 second_moment=element master_dtype=fp32 state, converted once to this run's "
            "state_dtype=bf16 second_moment=row master_dtype=bf16 (docs/checkpoints.md)") in err


LAYERS, STEPS, LR = (1, 2), 4, 1e-2


def _tokens(step: int, rank: int) -> torch.Tensor:
    """Frequent low ids and a long tail: the ranks of a step share hot rows."""
    p = torch.arange(1, V + 1, dtype=torch.float64) ** -1.1
    return torch.multinomial(p, 32, replacement=True, generator=torch.Generator().manual_seed(step * 101 + rank))


def _train(store, first: int, last: int) -> None:
    """Steps ``first`` to ``last`` as training drives the store, with gradients whose sums over the ranks are exact
    in fp32 (multiples of 2^-12 below 2^-6): every layout adds them to the same bits."""
    rank = torch.distributed.get_rank()
    batches = iter([{"tokens": _tokens(step, rank).view(2, 16)} for step in range(first, last + 2)])
    with store.stream(batches, 1) as data:
        for step in range(first, last + 1):
            fetched = next(data)["stem"]
            for layer in LAYERS:
                g = torch.Generator().manual_seed(step * 7 + layer + 1000 * rank)
                store.rows(layer, fetched).backward(torch.randint(-64, 64, (fetched.uniq.numel(), D_FF),
                                                                  generator=g) * 2.0**-12)
            data.reduce_gradients()
            data.step(LR)


def _by_token(store) -> dict:
    """Every kind of each layer's state by token id, gathered from the nodes' owners."""
    import torch.distributed as dist

    store.settle()
    own = store.record.own
    ids = own.ids_at(torch.arange(own.lo, own.hi))
    mine = {(kind, layer): t[layer].clone() for kind, t in vars(store.record.state).items() for layer in LAYERS}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (ids, mine) if store.record.node.peer_index == 0 else None)
    whole = {}
    for ids, rows in filter(None, parts):
        for key, values in rows.items():
            whole.setdefault(key, torch.zeros(V, values.shape[1], dtype=values.dtype))[ids] = values
    return whole


def _lean_layout(nodes: int, optimizer: str, directory, stop: int | None):
    """Lean state trained ``STEPS`` steps on 2 ranks as ``nodes`` nodes; with ``stop``, saved after that step and
    resumed in a new store (a new run's process)."""
    import os

    from stem_megatron.checkpoint import host_tables

    os.environ["GROUP_RANK"] = str(torch.distributed.get_rank() * nodes // 2)  # the launcher's node
    store = _store(dict(LEAN, optimizer=optimizer), LAYERS)
    _train(store, 1, stop or STEPS)
    if stop:
        member = _Member(store)
        host_tables.save(member, member.sharded_state_dict(), directory)
        del store, member
        store = _store(dict(LEAN, optimizer=optimizer), LAYERS)
        host_tables.load(_Member(store), directory, steps_done=stop)
        _train(store, stop + 1, STEPS)
    return _by_token(store)


def test_lean_state_trains_bitwise_alike_on_one_node_two_nodes_and_resumed(tmp_path):
    """Lean state (bf16 moments and masters, a row-wise second moment), dense Adam (rows with and without a gradient),
    2 DP ranks: one node, and two emulated nodes (each row updated by its owner node, pulled by the other) saved after
    step 2 and resumed in new stores, end with the same bits in every kind: the rounding draws from (step, layer,
    token, column), not from where a row lives. (Lazy, and TP: tests/test_working_set.py's lean cases.)"""
    one = distributed.run(_lean_layout, 2, 1, "dense", None, None)[0]
    two = distributed.run(_lean_layout, 2, 2, "dense", tmp_path / "stem", 2)[0]
    assert one.keys() == two.keys() and one[("master", 1)].dtype == torch.bfloat16
    for key, value in one.items():
        assert torch.equal(value, two[key]), key
    assert not torch.equal(one[("master", 1)], one[("master", 2)])  # trained, and per layer


class _Host:
    """A host record whose row of an id is the id (``HostRecord``'s face to a working set)."""

    def __init__(self, state):
        self.state = state

    def local(self, ids):
        return ids

    def write(self, layer, kind, ids, rows):
        self.state.kind(kind)[layer][ids] = rows


def _lean_slots(where: str, dense: bool):
    """Lean rows (100 columns of a TP block at column 128, a second moment per 10 columns) after one update of 40 of
    them (dense: and the other 8 resident ones), in a working set's slots by ``where`` (``rows``: the host's C++
    kernel; ``fused``: the GPU's torch definition, here on CPU) or on the host record itself (``host``)."""
    from stem_megatron.host_tables.row_optimizer import RowAdam, RowOptimizer
    from stem_megatron.host_tables.row_state import RowState
    from stem_megatron.host_tables.working_set import WorkingSet
    from stem_megatron.table_state import StateSpec

    spec, cpu, rows, cols = StateSpec("bf16", "row", "bf16"), torch.device("cpu"), 200, 100
    g = torch.Generator().manual_seed(3)
    state = RowState.zeros([1], rows, cols, cpu, spec, blocks=10)
    state.master[1].copy_(torch.randn(rows, cols, generator=g) * 0.02)
    state.exp_avg[1].copy_(torch.randn(rows, cols, generator=g) * 1e-3)
    state.exp_avg_sq[1].copy_(torch.rand(rows, 10, generator=g) * 1e-6)
    resident, ids = torch.arange(0, 96, 2), torch.arange(0, 80, 2)
    grads = torch.randn(ids.numel(), cols, generator=g) * 1e-2
    optimizer = RowOptimizer(RowAdam((0.9, 0.95), 1e-8, 0.1), "rows" if where == "host" else where, cpu, dense, spec,
                             seed=9, col0=128)
    if where == "host":
        optimizer.update(7, 3e-3, state, 1, ids, grads, untouched=resident[ids.numel():] if dense else ids[:0])
        return state
    ws = WorkingSet([1], 48, rows, cols, cpu, torch.bfloat16, _Host(state), optimizer)
    ws.admit(resident)
    ws.update(7, 3e-3, 1, ids, grads)
    ws.write_back()
    return state


@pytest.mark.parametrize("dense", [False, True], ids=["lazy", "dense"])
def test_lean_slots_update_bitwise_as_the_host_by_either_kernel(dense):
    """A working set's lean update rounds each slot by its row's token id: its slots end bitwise as the host record's
    rows updated in place, by the C++ kernel and by the torch definition a GPU runs."""
    host = _lean_slots("host", dense)
    for where in ("rows", "fused"):
        slots = _lean_slots(where, dense)
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(slots.kind(kind)[1], host.kind(kind)[1]), (where, kind)
