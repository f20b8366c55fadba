"""The working set (``host_tables.resident_rows``, host_tables/working_set.py): the rows a step reads kept with their
Adam state where the step runs, updated there, entering and leaving as steps go. On CPU it runs the host path's kernel,
so training is bitwise the training without it (losses, tables, moments), through rows entering and leaving, a set that
grows, reads of the whole tables mid-run (checkpoints, export) and validation. The GPU's kernel (torch's fused AdamW)
runs here too, against DeepSpeed's within a stated bound."""

import distributed
import pytest
import torch

from stem_megatron.config import HostTablesConfig, ModelConfig, ParallelConfig, RunConfig, STEMConfig, TrainConfig

MICRO, GLOBAL, STEPS = 2, 4, 8
LEAN = dict(state_dtype="bf16", second_moment="row", master_dtype="bf16", read_dtype="bf16")  # docs/lean_tables.md
MODEL = ModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=128,
                    seq_length=16)


def _data(steps, seed=11):
    """This DP rank's share of a new global batch a step: 64 tokens, ~50 distinct ids of 128."""
    from megatron.core import parallel_state

    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        seqs = torch.randint(0, MODEL.vocab_size, (GLOBAL, MODEL.seq_length + 1), generator=g)
        for k in range(rank, GLOBAL // MICRO, dp):
            s = seqs[k * MICRO:(k + 1) * MICRO]
            yield {"tokens": s[:, :-1], "labels": s[:, 1:]}


def _slow_decay():
    """Dense Adam's decay beside the next step (``LaterDecay``) a row at a time, 2 ms each: the prefetch thread's
    preload of the step after comes while that decay is under way, and must wait for its rows."""
    import time

    from stem_megatron.host_tables import adam_thread

    adam_thread.CHUNK_ELEMENTS = 1
    run = adam_thread.LaterDecay.run

    def slowly(self, ids, decay):
        return run(self, ids, lambda chunk: (time.sleep(0.002), decay(chunk)))

    adam_thread.LaterDecay.run = slowly


def _train(tp, pp, optimizer, read_dtype, resident_rows):
    """``STEPS`` steps; after steps 3 and 6 the whole tables are read (as a checkpoint or an export reads them) and
    a validation pass runs on the same store. Returns losses, grad norms, validation losses, the tables and moments,
    and the working set's counters. With a dense working set the decay beside the step is slowed (``_slow_decay``)."""
    from megatron.core import parallel_state
    from stem_megatron.training.setup import setup_model
    from stem_megatron.training.step import forward_backward, train_step

    state = LEAN if read_dtype == "lean" else {"read_dtype": read_dtype}
    cfg = RunConfig(model=MODEL, stem=STEMConfig(variant="stem", ratio="1/2"),
                    host_tables=HostTablesConfig(placement="host", optimizer=optimizer, resident_rows=resident_rows,
                                                 **state),
                    parallel=ParallelConfig(tp, pp),
                    train=TrainConfig(steps=STEPS, micro_batch_size=MICRO, global_batch_size=GLOBAL, lr=1e-2))
    if resident_rows and optimizer == "dense":
        _slow_decay()
    torch.manual_seed(0)
    trainer = setup_model(cfg)
    store = trainer.tables
    n_micro = GLOBAL // (MICRO * parallel_state.get_data_parallel_world_size())
    out = {"loss": [], "grad_norm": [], "valid": [], "tables_mid": [], "entered": 0, "ahead": 0, "staged": 0,
           "left": 0, "asked": 0}
    with store.stream(_data(STEPS), n_micro) as data:
        for step in range(1, STEPS + 1):
            result = train_step(trainer, data, n_micro, MICRO, MODEL.seq_length, MODEL.vocab_size)
            out["loss"].append(result["loss"])
            out["grad_norm"].append(result["grad_norm"])
            stats = store.take_stats()
            out["entered"] += stats.get("stem_rows_entered", 0)
            out["left"] += stats.get("stem_rows_left", 0)
            out["ahead"] += stats.get("stem_rows_entered_ahead", 0)
            out["staged"] += stats.get("stem_rows_entered_staged", 0)
            out["asked"] += stats.get("stem_decay_rows_asked", 0)
            if step in (3, 6):
                out["tables_mid"].append({layer: store.table(layer) for layer in store.layers})
                trainer.model.eval()
                with store.stream(_data(1, seed=99), n_micro, training=False) as valid, torch.no_grad():
                    out["valid"].append(forward_backward(trainer.model, valid, n_micro, MICRO, MODEL.seq_length,
                                                         MODEL.vocab_size, forward_only=True))
                trainer.model.train()
    store.settle()
    out["tables"] = {layer: store.table(layer) for layer in store.layers}
    out["moments"] = {(layer, kind): store.record.state.kind(kind)[layer].clone()
                      for layer in store.layers for kind in ("exp_avg", "exp_avg_sq")}
    return out


def _compare(tp, pp, optimizer, read_dtype, resident_rows):
    return _train(tp, pp, optimizer, read_dtype, 0), _train(tp, pp, optimizer, read_dtype, resident_rows)


CASES = {  # (tp, pp, dp, optimizer, read_dtype, resident_rows): rows enter and leave every step (~50 distinct of 64;
    # at DP 2 a rank holds the ~25 of them it owns, of its 64 rows); "lean": the lean row state (bf16 copies)
    "tp2-lazy": (2, 1, 1, "lazy", "fp32", 64),
    "pp2-dense-bf16": (1, 2, 1, "dense", "bf16", 64),
    "dp2-tp2-lazy": (2, 1, 2, "lazy", "fp32", 32),
    "pp2-dp2-dense-bf16": (1, 2, 2, "dense", "bf16", 32),
    "dp2-tp2-lazy-lean": (2, 1, 2, "lazy", "lean", 32),
    "pp2-dense-lean": (1, 2, 1, "dense", "lean", 64),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_working_set_trains_bitwise_like_the_host_step(case):
    """At DP = 2 each rank's set holds the rows it owns and every rank reads its step's rows from their owners
    (``device_tier.OwnerTier``), loading its rows of a step as its prefetch thread plans it: still bitwise the host
    step, whose owners update on the host and pull. With dense Adam the rows loaded ahead are those whose host decay
    of the step before was asked for first, while that decay ran a row at a time."""
    tp, pp, dp, optimizer, read_dtype, resident_rows = CASES[case]
    runs = distributed.run(_compare, tp * pp * dp, tp, pp, optimizer, read_dtype, resident_rows, tp=tp, pp=pp)
    for rank, (plain, resident) in enumerate(runs):
        assert resident["loss"] == plain["loss"], f"rank {rank}: losses differ"
        assert resident["grad_norm"] == plain["grad_norm"], f"rank {rank}: grad norms differ"
        assert resident["valid"] == plain["valid"] and len(plain["valid"]) == 2, f"rank {rank}: validation differs"
        for mid_plain, mid_resident in zip(plain["tables_mid"], resident["tables_mid"]):
            assert all(torch.equal(mid_plain[layer], mid_resident[layer]) for layer in mid_plain)
        assert plain["tables"].keys() == resident["tables"].keys()
        for layer, table in plain["tables"].items():
            assert torch.equal(resident["tables"][layer], table), f"rank {rank}: U_{layer} differs"
        for key, moment in plain["moments"].items():
            assert torch.equal(resident["moments"][key], moment), f"rank {rank}: {key} differs"
        if plain["tables"]:  # a stage with STEM layers: rows entered and left the set
            assert resident["entered"] > 0 and resident["left"] > 0, resident
            # rows enter while the step before runs (the prefetch thread; at DP = 2 those the rank owns of its plan of
            # the step); others are staged then (no slot free yet) and enter at its end (with dense Adam decayed in
            # their slots there); with dense Adam the prefetch thread waited for the decay of the rows it read
            assert resident["ahead"] > 0 and resident["staged"] > 0, resident
            assert (resident["asked"] > 0) == (optimizer == "dense"), resident



class _Host:
    """A host record whose row of an id is the id (``HostRecord``'s face to a working set)."""

    def __init__(self, master, exp_avg, exp_avg_sq):
        from stem_megatron.host_tables.row_state import RowState

        self.state = RowState(master, exp_avg, exp_avg_sq)

    def local(self, ids):
        return ids

    def write(self, layer, kind, ids, rows):
        self.state.kind(kind)[layer][ids] = rows


def _optimizer(kernel="rows", dense=False):
    from stem_megatron.host_tables.row_optimizer import RowAdam, RowOptimizer

    return RowOptimizer(RowAdam((0.9, 0.95), 1e-8, 0.1), kernel, torch.device("cpu"), dense)


def _one_update(kernel, dense, step=7):
    """A working set of 48 slots over 200 rows of 256 columns (a whole number of DeepSpeed's SIMD spans, as the
    paper's d_ff), state drawn as after some training; one AdamW step of 40 rows (lazy) or every resident row
    (dense). Returns, for the masters and both moments, (the resident rows' value before, after)."""
    from stem_megatron.host_tables.working_set import WorkingSet

    g = torch.Generator().manual_seed(3)
    V, cols = 200, 256
    master, m = torch.randn(V, cols, generator=g), torch.randn(V, cols, generator=g) * 1e-2
    v = torch.rand(V, cols, generator=g) * 1e-4
    host = _Host({1: master}, {1: m}, {1: v})
    ws = WorkingSet([1], 48, V, cols, torch.device("cpu"), torch.float32, host, _optimizer(kernel, dense))
    ws.admit(torch.arange(0, 96, 2))
    ids = torch.arange(0, 80, 2)
    ws.update(step, 3e-3, 1, ids, torch.randn(ids.numel(), cols, generator=g) * 1e-2)
    before = dict(master=master, exp_avg=m, exp_avg_sq=v)
    return {kind: (before[kind][0:96:2], ws.state.kind(kind)[1][:48].clone()) for kind in before}


@pytest.mark.parametrize("dense", [False, True])
def test_the_gpu_kernel_is_deepspeeds_update_within_fp32_rounding(dense):
    """torch's fused AdamW (the working set's kernel on GPU, run here on CPU) against DeepSpeed's (the host path's):
    the same update, other rounding. Bound, per element of the masters and both moments after one step:
    |difference| <= 4 eps (|value before| + |its change|), eps = 2^-23 (measured: 2.9 eps at most)."""
    rows, fused = _one_update("rows", dense), _one_update("fused", dense)
    eps = torch.finfo(torch.float32).eps
    for kind, (old, new) in rows.items():
        assert not torch.equal(new, old), f"{kind}: the rows did not move"
        off = (fused[kind][1] - new).abs() / (eps * (old.abs() + (new - old).abs()))
        assert off.max() <= 4, f"{kind}: {off.max():.1f} eps"
        assert off.max() > 0, f"{kind}: bitwise equal: the fused kernel did not run"


def _staged_run(staged_rows, switch_at=None, dense=False):
    """A set of 40 slots, 2 layers of 200 rows, 10 steps of ~28 distinct ids each loaded ahead as the prefetch
    thread does (``preload`` before the step before is updated; two steps read ~50 rows, so some find no slot then);
    ``staged_rows``: the most rows a layer staged ahead (0: none). ``switch_at``: that step admits other ids than
    the ones preloaded. ``dense``: the recipe's dense Adam, whose rows outside the set decay on the host (the entering
    ones in ``admit``, the others after it, as ``device_tier`` does). Returns the slots' state and map after every
    step, the host record at the end, the counters."""
    from stem_megatron.host_tables.adam_thread import MissedUpdate
    from stem_megatron.host_tables.row_state import KINDS
    from stem_megatron.host_tables.staged_rows import StagedRows
    from stem_megatron.host_tables.working_set import WorkingSet

    g = torch.Generator().manual_seed(5)
    V, cols, layers = 200, 16, [1, 2]
    master = {layer: torch.randn(V, cols, generator=g) for layer in layers}
    zeros = lambda: {layer: torch.zeros(V, cols) for layer in layers}  # noqa: E731
    host = _Host(master, zeros(), zeros())
    optimizer = _optimizer(dense=dense)
    adam = optimizer.adam
    ws = WorkingSet(layers, 40, V, cols, torch.device("cpu"), torch.float32, host, optimizer, ahead=True)
    ws.staged = StagedRows(layers, cols, staged_rows)
    steps = [torch.unique(torch.randint(0, V, (30,), generator=g)) for _ in range(12)]
    grads = [torch.randn(200, cols, generator=g) for _ in range(12)]
    ws.admit(steps[0])
    seen, decayed = [], []  # (dense) the entering rows decayed on the host, each admit
    for s in range(1, 11):
        ws.preload(steps[s])
        if dense:
            ws.begin_update()
        for layer in layers:
            ws.update(s, 1e-2, layer, ws.running, grads[s][:ws.running.numel()] * layer)
        ids, missed = steps[11] if s == switch_at else steps[s], None
        if dense:
            def on_host(rows, s=s):
                for layer in layers:
                    adam.update_untouched_rows(s, 1e-2, rows, *(host.state.kind(k)[layer] for k in KINDS))
            outside = ws.slot_of < 0
            outside[ids] = False
            at_admit = lambda rows, on_host=on_host: (on_host(rows), decayed.append(rows.numel()))  # noqa: E731
            rest, missed = outside.nonzero().squeeze(1), MissedUpdate(s, 1e-2, at_admit)
        land = ws.admit(ids, missed)
        if land is not None:
            land()
        if dense:
            on_host(rest)
        state = {layer: {kind: t.clone() for kind, t in ws.state.layer(layer).items()} for layer in layers}
        seen.append((ws.slot_of.clone(), state))
    ws.write_back()
    return seen, host, dict(ws.stats, decayed_on_host=sum(decayed))


@pytest.mark.parametrize("dense", [False, True])
def test_rows_staged_ahead_enter_as_they_would_at_the_steps_end(dense):
    """Rows that find no slot while the step before runs are gathered then (``StagedRows``) and put in place at
    ``admit``: every step's slots (map, masters, moments) and the host record at the end are bitwise those of a set
    that gathers them at ``admit``, whether all fit the staging or only some, and where a step admits other ids than
    the ones staged for it (the staging is then not used). With dense Adam the staged rows take the step's decay in
    their slots, where the others take it on the host before they load."""
    plains = {switch_at: _staged_run(0, switch_at, dense) for switch_at in (None, 5)}
    assert plains[None][2]["rows_entered_staged"] == 0
    for staged_rows, switch_at in ((64, None), (3, None), (64, 5)):
        seen, host, stats = _staged_run(staged_rows, switch_at, dense)
        plain, plain_host, plain_stats = plains[switch_at]
        assert stats["rows_entered_staged"] > 0, stats
        if staged_rows == 3:  # more rows than it stages: the rest are gathered at admit
            assert stats["rows_entered"] - stats["rows_entered_ahead"] > stats["rows_entered_staged"], stats
        assert stats["rows_entered"] == plain_stats["rows_entered"], (stats, plain_stats)
        if dense:  # the staged rows decay in their slots only, once (``rows_entered_staged`` counts both layers)
            assert (plain_stats["decayed_on_host"] - stats["decayed_on_host"]) * 2 == stats["rows_entered_staged"]
        for step, ((slot_of, state), (plain_slot_of, plain_state)) in enumerate(zip(seen, plain), 1):
            assert torch.equal(slot_of, plain_slot_of), step
            for layer, kinds in plain_state.items():
                for kind, value in kinds.items():
                    assert torch.equal(state[layer][kind], value), (step, layer, kind)
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            for layer, value in plain_host.state.kind(kind).items():
                assert torch.equal(host.state.kind(kind)[layer], value), (kind, layer)


def test_the_decay_beside_the_step_takes_asked_rows_first_and_ends_as_in_one_piece():
    """``LaterDecay`` decays 300 rows in chunks of 4 on another thread (the Adam thread's part); a ``wait_for`` of
    rows near the end returns once those have decayed, long before the rest, and the tables end bitwise as one call
    of the kernel over every row leaves them, each row decayed once. A failing decay fails the waiter, not hangs it."""
    import threading
    import time

    from stem_megatron.host_tables.adam_thread import CHUNK_ELEMENTS, LaterDecay
    from stem_megatron.host_tables.row_optimizer import RowAdam

    g = torch.Generator().manual_seed(2)
    V, cols = 400, 8
    state = [torch.randn(V, cols, generator=g), torch.randn(V, cols, generator=g) * 1e-2,
             torch.rand(V, cols, generator=g) * 1e-4]
    adam, ids = RowAdam((0.9, 0.95), 1e-8, 0.1), torch.arange(50, 350)
    expected = [t.clone() for t in state]
    adam.update_untouched_rows(5, 1e-2, ids, *expected)

    chunks = []

    def decay(chunk):
        time.sleep(0.005)
        adam.update_untouched_rows(5, 1e-2, chunk, *state)
        chunks.append(chunk)

    later = LaterDecay(V, CHUNK_ELEMENTS // 4)  # 4 rows a chunk
    later.expect(ids)
    worker = threading.Thread(target=later.run, args=(ids, decay))
    worker.start()
    asked = torch.tensor([340, 7, 345, 320])  # 7: not due, nothing to wait for
    later.wait_for(asked)
    decayed = torch.cat(chunks)
    assert torch.isin(asked[asked != 7], decayed).all() and decayed.numel() < ids.numel() / 2, decayed.numel()
    assert later.stats["decay_rows_asked"] == 3
    worker.join()
    decayed = torch.cat(chunks)
    assert torch.equal(torch.sort(decayed).values, ids), "every row decayed once"
    assert all(torch.equal(a, b) for a, b in zip(state, expected))
    later.wait_for(ids)  # nothing due any more: returns at once

    def failing(chunk):
        time.sleep(0.05)
        raise OSError("boom")

    errors = []

    def run_failing():
        try:
            later.run(ids, failing)
        except OSError as error:
            errors.append(error)

    later.expect(ids)
    worker = threading.Thread(target=run_failing)
    worker.start()
    with pytest.raises(RuntimeError, match="dense decay of the step before failed"):
        later.wait_for(torch.tensor([300]))
    worker.join()
    assert errors, "the decay's own error reaches its thread (the training thread's settle)"


def test_a_dense_set_loads_ahead_only_until_the_step_before_begins_its_update():
    """With dense Adam every resident slot updates every step, so a row may load ahead only while the step before
    has not begun its update (which then covers it), and rows are staged only then too (``admit`` decays them with
    that update, which they missed); ``preload`` after ``begin_update`` loads and stages nothing (``admit`` loads
    those rows, after the host decayed them)."""
    from stem_megatron.host_tables.working_set import WorkingSet

    V, cols = 100, 8
    master = {1: torch.randn(V, cols)}
    host = _Host(master, {1: torch.zeros(V, cols)}, {1: torch.zeros(V, cols)})
    ws = WorkingSet([1], 20, V, cols, torch.device("cpu"), torch.float32, host, _optimizer(dense=True), ahead=True)
    ws.preload(torch.arange(10))  # before any admit: no step before it to update it
    assert ws.stats["rows_entered_ahead"] == 0 and ws.staged.ids is None
    ws.admit(torch.arange(10))
    ws.preload(torch.arange(5, 30))  # 20 rows enter, 10 slots are free: 10 load, the other 10 are staged
    assert ws.stats["rows_entered_ahead"] == 10 and bool((ws.slot_of[10:20] >= 0).all())
    assert torch.equal(ws.staged.ids, torch.arange(20, 30))
    ws.begin_update()
    ws.preload(torch.arange(30, 40))
    assert ws.stats["rows_entered_ahead"] == 10 and bool((ws.slot_of[30:40] < 0).all())
    assert torch.equal(ws.staged.ids, torch.arange(20, 30))


@pytest.mark.slow
def test_a_run_with_a_working_set_resumes_exactly_and_equals_the_host_step(runs, tmp_path):
    """The training loop at TP=2: 8 steps with the host step, and 4 + 4 with a working set stopped and resumed from
    its step-4 checkpoint, validating at steps 4 and 8. Losses, grad norms, validation losses and every exported
    weight (U_l included) are bitwise equal: the checkpoint and the export read the set's rows written back."""
    from runs import train

    host = runs.shared("parallel=tp2", nproc=2)
    # ~40 distinct ids a step: the set grows, then rows leave
    resident = ("parallel=tp2", "host_tables.resident_rows=16")
    first = train(runs.corpus, tmp_path, *resident, "train.exit_after_steps=4", nproc=2)
    assert "working set grows" in first.stdout
    second = train(runs.corpus, tmp_path, *resident, nproc=2)
    assert "resumed from" in second.stdout
    ws = second.metrics
    for key in ("step", "loss", "grad_norm", "valid_loss"):
        assert [r.get(key) for r in ws] == [r.get(key) for r in host.metrics], key
    assert sum("valid_loss" in r for r in host.metrics) == 2
    assert sum(r.get("stem_rows_left", 0) for r in ws) > 0
    a, b = host.weights(), second.weights()
    assert a.keys() == b.keys() and any(".U_l." in k for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
