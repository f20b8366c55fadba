"""The host-resident STEM store: same training as the on-device table, lazy updates leave untouched
rows alone, one copy of the tables per node, prefetch errors surface with their cause."""

import dataclasses
import os

import distributed
import pytest
import torch

from stem_megatron.config import (
    DataConfig,
    HostTablesConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    STEMConfig,
    TrainConfig,
)

MICRO, GLOBAL, STEPS = 2, 4, 20
MODEL = ModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=128,
                    seq_length=16)


def _cfg(tp, pp, placement, optimizer="dense", steps=STEPS, table_init="scaled", resident_rows=0):
    return RunConfig(model=MODEL, stem=STEMConfig(variant="stem", ratio="1/2", table_init=table_init),
                     host_tables=HostTablesConfig(placement=placement, optimizer=optimizer,
                                                  resident_rows=resident_rows),
                     parallel=ParallelConfig(tp, pp),
                     train=TrainConfig(steps=steps, micro_batch_size=MICRO, global_batch_size=GLOBAL, lr=1e-2))


def _data(dp_rank, dp, steps=STEPS):
    """A new global batch each step; micro-batch k of DP rank r holds sequences (k*dp + r)*MICRO ..."""
    g = torch.Generator().manual_seed(11)
    for _ in range(steps):
        seqs = torch.randint(0, MODEL.vocab_size, (GLOBAL, MODEL.seq_length + 1), generator=g)
        for k in range(GLOBAL // (MICRO * dp)):
            s = seqs[(k * dp + dp_rank) * MICRO:(k * dp + dp_rank + 1) * MICRO]
            yield {"tokens": s[:, :-1], "labels": s[:, 1:]}


def _device_tables(model):
    """V x d_ff tables of the on-device STEM layers of this stage (TP column blocks gathered)."""
    from megatron.core import parallel_state

    from stem_megatron.model.stem_mlp import STEMMLP

    tables = {}
    for module in model.modules():
        if isinstance(module, STEMMLP):
            tp_group = parallel_state.get_tensor_model_parallel_group()
            parts = [torch.empty_like(module.U_l.weight) for _ in range(torch.distributed.get_world_size(tp_group))]
            torch.distributed.all_gather(parts, module.U_l.weight.detach(), group=tp_group)
            tables[module.layer_number] = torch.cat(parts, dim=1)
    return tables


def _host_vs_device(tp, pp, table_init):
    """20 steps with the host store (dense CPU Adam = AdamW on every row) vs the device table; both draw
    their own tables (the same values), the dense weights are copied."""
    from megatron.core import parallel_state
    from stem_megatron.training.setup import setup_model
    from stem_megatron.training.step import train_step

    dev = setup_model(_cfg(tp, pp, "device", table_init=table_init))
    host = setup_model(_cfg(tp, pp, "host", table_init=table_init))
    dev_params = dict(dev.model.module.named_parameters())
    with torch.no_grad():
        for name, p in host.model.module.named_parameters():
            p.copy_(dev_params[name])
    assert sorted(host.tables.layers) == sorted(_device_tables(dev.model))
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    n_micro = GLOBAL // (MICRO * dp)
    dev_data = _data(dp_rank, dp)
    errors = {"loss": 0.0, "grad_norm": 0.0}
    with host.tables.stream(_data(dp_rank, dp), n_micro) as host_data:
        for _ in range(STEPS):
            a = train_step(dev, dev_data, n_micro, MICRO, MODEL.seq_length, MODEL.vocab_size)
            b = train_step(host, host_data, n_micro, MICRO, MODEL.seq_length, MODEL.vocab_size)
            errors["loss"] = max(errors["loss"], abs(a["loss"] - b["loss"]))
            # relative above 1: fp32 sums in another order, amplified where the norm spikes (4.05 at dp2's step 19)
            errors["grad_norm"] = max(errors["grad_norm"],
                                      abs(a["grad_norm"] - b["grad_norm"]) / max(1.0, a["grad_norm"]))
    errors["dense_weights"] = max((p - dev_params[n]).abs().max().item()
                                  for n, p in host.model.module.named_parameters())
    dev_tables = _device_tables(dev.model)
    errors["tables"] = max([(host.tables.table(layer) - t).abs().max().item() for layer, t in dev_tables.items()],
                           default=0.0)
    errors["tables_checked"] = len(dev_tables)
    return errors


LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}  # (tp, pp) on two processes


@pytest.mark.slow
@pytest.mark.parametrize("layout, table_init", [(layout, "scaled") for layout in LAYOUTS] + [("tp2", "xavier")])
def test_host_store_trains_like_device_table(layout, table_init):
    tp, pp = LAYOUTS[layout]
    results = distributed.run(_host_vs_device, 2, tp, pp, table_init, tp=tp, pp=pp)
    assert sum(r["tables_checked"] for r in results) > 0
    for rank, e in enumerate(results):
        assert e["loss"] < 1e-4, f"{layout} rank {rank}: losses differ by {e['loss']}"
        assert e["grad_norm"] < 1e-4, f"{layout} rank {rank}: grad norms (clipping) differ by {e['grad_norm']}"
        assert e["dense_weights"] < 1e-4, f"{layout} rank {rank}: dense weights differ by {e['dense_weights']}"
        assert e["tables"] < 1e-4, f"{layout} rank {rank}: table rows differ by {e['tables']}"


def _lazy_untouched_rows():
    """A lazy step at DP=2 (the second: the first has lr 0 in warmup): rows no replica touched in it are
    bit-identical afterwards, touched rows moved."""
    from megatron.core import parallel_state
    from stem_megatron.training.setup import setup_model
    from stem_megatron.training.step import train_step

    trainer = setup_model(_cfg(1, 1, "host", optimizer="lazy", steps=2))
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    n_micro = GLOBAL // (MICRO * dp)
    step2 = [b["tokens"].flatten() for r in range(dp) for b in list(_data(r, dp, steps=2))[n_micro:]]
    touched = torch.unique(torch.cat(step2))
    with trainer.tables.stream(_data(dp_rank, dp, steps=2), n_micro) as data:
        train_step(trainer, data, n_micro, MICRO, MODEL.seq_length, MODEL.vocab_size)
        before = {layer: trainer.tables.table(layer) for layer in trainer.tables.layers}
        out = train_step(trainer, data, n_micro, MICRO, MODEL.seq_length, MODEL.vocab_size)
    assert out["lr"] > 0
    untouched = torch.ones(MODEL.vocab_size, dtype=torch.bool)
    untouched[touched] = False
    out = {}
    for layer, old in before.items():
        new = trainer.tables.table(layer)
        moved = bool((new[touched] != old[touched]).all(dim=1).all())
        out[layer] = (torch.equal(new[untouched], old[untouched]), moved, int(untouched.sum()))
    return out


@pytest.mark.slow
def test_lazy_step_leaves_untouched_rows_bit_identical():
    for per_layer in distributed.run(_lazy_untouched_rows, 2):
        assert per_layer
        for layer, (same, moved, n_untouched) in per_layer.items():
            assert n_untouched > 0
            assert same, f"layer {layer}: a row no token touched changed"
            assert moved, f"layer {layer}: a touched row did not change"


def _table_mappings() -> dict:
    """Rss and Pss (bytes) of this process's mappings of STEM table files in /dev/shm."""
    totals, inside = {"Rss": 0, "Pss": 0}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and ":" not in fields[0]:  # a mapping's header line
                inside = "/dev/shm/stem-" in line
            elif inside and fields[0].rstrip(":") in totals:
                totals[fields[0].rstrip(":")] += int(fields[1]) * 1024
    return totals


def _shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _memory_per_node():
    """Both ranks (one node, DP=2) attach the same tables and read every page."""
    import torch.distributed as dist

    from stem_megatron.host_tables.store import HostTableStore, StoreConfig

    dist.barrier()
    shm0 = _shm_used()
    store = HostTableStore(StoreConfig((1, 2), vocab_size=8192, d_ff=512, init_std=1.0, seed=0))
    dist.barrier()
    total = sum(float(t.sum()) for t in store.record.full.values())  # fault in every page in this process
    dist.barrier()
    measured = {"shm": _shm_used() - shm0, "bytes": store.host_bytes, "total": total, **_table_mappings()}
    dist.barrier()  # a rank that returned would unmap its pages while the other still measures its share
    return measured


def _rows_held(resident_rows: int):
    """Two steps of two micro-batches; each registered row leaf watched through a weak reference."""
    import weakref
    from stem_megatron.training.setup import setup_model
    from stem_megatron.training.step import train_step

    trainer = setup_model(_cfg(1, 1, "host", optimizer="lazy", steps=2, resident_rows=resident_rows))
    store, watched, alive_at_register = trainer.tables, [], []
    rows_of = store.rows

    def watching(layer, prefetched):
        leaf = rows_of(layer, prefetched)
        alive_at_register.append(sum(ref() is not None for ref in watched))
        watched.append(weakref.ref(leaf))
        return leaf

    store.rows = watching
    n_micro = GLOBAL // MICRO
    tokens = [b["tokens"] for b in _data(0, 1, steps=2)]
    peaks = []
    with store.stream(_data(0, 1, steps=2), n_micro) as data:
        for _ in range(2):
            train_step(trainer, data, n_micro, MICRO, MODEL.seq_length, MODEL.vocab_size)
            peaks.append(store.take_stats()["stem_device_row_bytes_peak"])
    layers, row = len(store.layers), store.cols * 4
    steps = [tokens[:n_micro], tokens[n_micro:]]
    step_ids = [torch.unique(torch.cat([t.flatten() for t in step])).numel() for step in steps]
    mb_ids = [max(torch.unique(t).numel() for t in step) for step in steps]
    return alive_at_register, peaks, layers, row, step_ids, mb_ids, n_micro


@pytest.mark.slow
@pytest.mark.parametrize("resident_rows", [0, MODEL.vocab_size])
def test_the_device_holds_one_micro_batch_of_rows_and_the_step_gradients(resident_rows):
    """Issue 26: a micro-batch's rows go once its backward has merged their gradients into the step's
    buffers: when a layer registers its rows, no earlier micro-batch's rows are alive (before, every
    micro-batch's stayed until the step's end). The counted peak is the step's merged buffers, one
    micro-batch's rows and one gradient being merged, which the memory plan covers at the measured distinct ids
    (its ``step_rows``; with a working set, whose rows the forward reads from its slots, the same, less the
    prefetcher's queue of rows: that queue holds slots)."""
    from stem_megatron.flops.memory import Layout, plan

    alive, peaks, layers, row, step_ids, mb_ids, n_micro = distributed.run(_rows_held, 1, resident_rows)[0]
    assert n_micro == 2 and len(alive) == 2 * n_micro * layers
    assert max(alive) == layers - 1, alive  # the same micro-batch's other layers only
    cfg = dataclasses.replace(_cfg(1, 1, "host", optimizer="lazy", steps=2, resident_rows=resident_rows),
                              data=DataConfig(vocab_size=MODEL.vocab_size))
    for peak, s, u in zip(peaks, step_ids, mb_ids):
        assert layers * s * row <= peak <= (layers * s + layers * u + u) * row, (peak, s, u)
        planned = plan(cfg, Layout(1, 1, device="cpu"), u, s)["stages"][0]["device"]["step_rows"]
        assert peak <= planned - layers * u * row * (not resident_rows), (peak, planned)


@pytest.mark.slow
def test_tables_are_allocated_once_per_node():
    results = distributed.run(_memory_per_node, 2)
    table_bytes = results[0]["bytes"]
    assert table_bytes == 2 * 3 * 8192 * 512 * 4  # 2 layers x (U_l + 2 moments), fp32
    shm = results[0]["shm"]
    assert 0.95 * table_bytes <= shm <= 1.05 * table_bytes, f"/dev/shm grew by {shm} for {table_bytes} of tables"
    for r in results:  # each rank sees every page of the tables (but the few a host's reclaim may page out between
        # the read and the count: DAMON's "pageout" scheme runs on this VM, /sys/kernel/mm/damon) ...
        assert 0.99 * table_bytes <= r["Rss"] <= table_bytes and r["total"] == results[0]["total"], r["Rss"]
    pss = sum(r["Pss"] for r in results)  # ... but the pages are shared: proportional sizes add up to one copy
    assert pss == pytest.approx(table_bytes, rel=0.01), f"two ranks hold {pss} B for {table_bytes} B of tables"


class _Boom(Exception):
    pass


def _failing_data():
    yield {"tokens": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 4, dtype=torch.long)}
    raise _Boom("disk went away")


def _prefetch_errors():
    from stem_megatron.host_tables.store import HostTableStore, StoreConfig

    store = HostTableStore(StoreConfig((1,), vocab_size=16, d_ff=8, init_std=1.0, seed=0))
    out = {}
    with store.stream(_failing_data(), 1) as prefetcher:
        next(prefetcher)
        try:
            next(prefetcher)
        except RuntimeError as e:
            out["cause"] = (type(e.__cause__).__name__, str(e.__cause__))

    fetches = []  # the ids' first use after the range check (transfer.fetch_rows)
    original = store.tier.cache.observe
    store.tier.cache.observe = lambda *a: fetches.append(a) or original(*a)
    bad = iter([{"tokens": torch.tensor([[1, 16]]), "labels": torch.tensor([[1, 2]])}])
    try:
        with store.stream(bad, 1) as prefetcher:
            next(prefetcher)
    except RuntimeError as e:
        out["bad_id"] = str(e.__cause__)
    out["fetches"] = len(fetches)
    return out


@pytest.mark.slow
def test_prefetch_errors_surface_with_cause_and_bad_ids_never_reach_lookup():
    out = distributed.run(_prefetch_errors, 1)[0]
    assert out["cause"] == ("_Boom", "disk went away")
    assert "token id 16" in out["bad_id"] and "vocab_size 16" in out["bad_id"]
    assert out["fetches"] == 0


def _freed_with_its_last_reference():
    import gc
    import weakref

    from stem_megatron.host_tables.store import HostTableStore, StoreConfig

    freed = {}
    for resident in (0, 8):  # the host tier, the device tier
        store = HostTableStore(StoreConfig((1,), vocab_size=16, d_ff=8, init_std=1.0, seed=0,
                                           host=HostTablesConfig(resident_rows=resident)))
        tokens = torch.tensor([[1, 2, 3]])
        with store.stream(iter([{"tokens": tokens, "labels": tokens}]), 1) as data:
            next(data)
        gc.disable()  # freed by its reference count, not by a collection that may come later
        try:
            ref = weakref.ref(store)
            del store, data
            freed[resident] = ref() is None
        finally:
            gc.enable()
    return freed


def test_a_store_is_freed_with_its_last_reference():
    """A store and its node's tables go when its last reference does (nothing it holds, its training pipeline
    included, points back to it): a process that builds one store after another (benchmarks/update_order.py, a
    study) holds one set of tables at a time."""
    assert distributed.run(_freed_with_its_last_reference, 1)[0] == {0: True, 8: True}


def _cache_is_transparent():
    """The same lazy training with and without a hot-row cache: identical losses and tables."""
    from megatron.core import parallel_state
    from stem_megatron.training.setup import setup_model
    from stem_megatron.training.step import train_step

    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    n_micro, out = GLOBAL // (MICRO * dp), {}
    for cache_rows in (0, 32):
        cfg = _cfg(1, 1, "host", optimizer="lazy", steps=6)
        cfg.host_tables.cache_rows = cache_rows
        torch.manual_seed(0)  # the same initial dense weights for both models
        trainer = setup_model(cfg)
        trainer.tables.tier.cache.refresh_every = 2  # re-choose the hot rows during the run too
        losses, hit_rates = [], []
        with trainer.tables.stream(_data(dp_rank, dp, steps=6), n_micro) as data:
            for _ in range(6):
                losses.append(train_step(trainer, data, n_micro, MICRO, MODEL.seq_length, MODEL.vocab_size)["loss"])
                hit_rates.append(trainer.tables.take_stats()["stem_cache_hit_rate"])
        out[cache_rows] = (losses, {layer: trainer.tables.table(layer) for layer in trainer.tables.layers}, hit_rates)
    return out


@pytest.mark.slow
def test_hot_row_cache_changes_nothing_but_the_hit_rate():
    for out in distributed.run(_cache_is_transparent, 2):
        (plain, plain_tables, no_hits), (cached, cached_tables, hits) = out[0], out[32]
        assert cached == plain
        assert all(torch.equal(plain_tables[layer], cached_tables[layer]) for layer in plain_tables)
        assert no_hits == [None] * 6
        assert hits[0] is None and all(0.0 < h <= 1.0 for h in hits[1:])  # cache filled after step 1
