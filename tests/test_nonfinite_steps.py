"""A step whose loss or gradients are not finite changes nothing and the run goes on (training/step.py, ``TableChain``,
``RowPipeline.skip``), exactly as a step ``train.skip_steps`` names; ``train.max_skipped_steps`` such steps in a row
stop the run with one line naming the step and the last good checkpoint (training/components/skipped_steps.py).

A step is made not finite from the test's own worker, on DP rank 1 only (the ranks must still agree): its model output
(the loss), one dense weight's gradient, or the STEM rows' gradient (a hook on the leaf ``HostTableStore.rows`` hands
the layer)."""

import json
import math

import distributed
import pytest
import torch

from stem_megatron.config import HostTablesConfig, ModelConfig, RunConfig, STEMConfig, TrainConfig

MICRO, GLOBAL, STEPS, BAD = 2, 4, 5, 3
MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=128,
                    seq_length=16)
KINDS = ("loss", "dense", "rows")


def _data(steps):
    """This DP rank's share of a new global batch a step."""
    from megatron.core import parallel_state

    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    g = torch.Generator().manual_seed(11)
    for _ in range(steps):
        seqs = torch.randint(0, MODEL.vocab_size, (GLOBAL, MODEL.seq_length + 1), generator=g)
        for k in range(rank, GLOBAL // MICRO, dp):
            s = seqs[k * MICRO:(k + 1) * MICRO]
            yield {"tokens": s[:, :-1], "labels": s[:, 1:]}


def _poison(trainer, kind, bad):
    """While ``bad[0]``, on DP rank 1: the model's output (``loss``), the first dense weight's gradient (``dense``) or
    every STEM row leaf's gradient (``rows``) times NaN."""
    from megatron.core import parallel_state

    if kind is None or parallel_state.get_data_parallel_rank() != 1:
        return
    nan = float("nan")
    if kind == "loss":
        trainer.model.register_forward_hook(lambda module, args, out: out * nan if bad[0] else None)
    elif kind == "dense":
        next(trainer.model.parameters()).register_hook(lambda grad: grad * nan if bad[0] else None)
    else:
        store, rows_of = trainer.tables, trainer.tables.rows

        def rows(layer, prefetched):
            leaf = rows_of(layer, prefetched)
            if bad[0] and leaf.requires_grad:
                leaf.register_hook(lambda grad: grad * nan)
            return leaf

        store.rows = rows


def _state(trainer) -> list[torch.Tensor]:
    """Every weight, dense Adam state, host table row (the node's copy and the owners' masters) and row moment."""
    store = trainer.tables
    out = [p.detach().clone() for p in trainer.model.parameters()]
    for member in trainer.optimizer.dense.chained_optimizers:
        out += [torch.as_tensor(v).clone() for s in member.optimizer.state.values() for v in s.values()]
    if not store.hosted:  # tables on the device: parameters
        return out
    store.settle()
    out += [store.table(layer) for layer in store.layers]
    out += [store.record.state.kind(k)[layer].clone() for layer in store.layers
            for k in ("master", "exp_avg", "exp_avg_sq")]
    return out + [torch.tensor(store.pipeline.steps_done)]


def _run(placement, resident_rows, kind):
    """``STEPS`` steps at DP 2; step ``BAD`` made not finite (``kind``) or, with no ``kind``, named by
    ``train.skip_steps``. Returns the records' losses and skips, and whether step ``BAD`` kept the state bitwise."""
    from stem_megatron.training.setup import setup_model
    from stem_megatron.training.step import train_step

    cfg = RunConfig(model=MODEL, stem=STEMConfig(variant="stem", ratio="1/2"),
                    host_tables=HostTablesConfig(placement=placement, optimizer="lazy", resident_rows=resident_rows),
                    train=TrainConfig(steps=STEPS, micro_batch_size=MICRO, global_batch_size=GLOBAL, lr=1e-2,
                                      warmup_ratio=0.0))
    torch.manual_seed(0)
    trainer, bad = setup_model(cfg), [False]
    _poison(trainer, kind, bad)
    n_micro = GLOBAL // (MICRO * 2)
    out = {"loss": [], "skipped": [], "lr": []}
    with trainer.tables.stream(_data(STEPS), n_micro) as data:
        for step in range(1, STEPS + 1):
            if step == BAD:
                before, bad[0] = _state(trainer), kind is not None
            record = train_step(trainer, data, n_micro, MICRO, MODEL.seq_length, MODEL.vocab_size,
                                skip=kind is None and step == BAD)
            bad[0] = False
            if step == BAD:
                out["kept"] = all(torch.equal(a, b) for a, b in zip(before, _state(trainer), strict=True))
            for key, field in (("loss", "loss"), ("skipped", "update_skipped"), ("lr", "lr")):
                out[key].append(record[field])
    return out


def _runs(placement, resident_rows, kinds):
    return {kind: _run(placement, resident_rows, kind) for kind in (None, *kinds)}


@pytest.mark.parametrize("placement, resident_rows, kinds", [("host", 0, KINDS), ("host", 32, KINDS),
                                                              ("device", 0, ("loss", "dense"))],
                         ids=["host-tier", "device-tier", "device-tables"])
def test_a_step_not_finite_changes_nothing_and_equals_a_skipped_step(placement, resident_rows, kinds):
    """At DP 2, on either tier: whichever part is not finite (on one rank), the step leaves every weight, Adam moment
    and table row bitwise as it was, the run goes on, and the losses after it are those of a run told to skip it. Tables
    on the device (megatron's optimizer alone, in a FiniteChain): a loss or a dense gradient that is not finite."""
    for rank, runs in enumerate(distributed.run(_runs, 2, placement, resident_rows, kinds)):
        told = runs.pop(None)
        assert told["kept"], f"rank {rank}: a step train.skip_steps names changed the state"
        assert told["skipped"] == [step == BAD for step in range(1, STEPS + 1)]
        for kind, run in runs.items():
            assert math.isnan(run["loss"][BAD - 1]) == (kind == "loss"), (kind, run["loss"])
            assert run["skipped"] == told["skipped"], f"rank {rank}, {kind}: {run['skipped']}"
            assert run["kept"], f"rank {rank}, {kind}: the step not finite changed the state"
            assert run["loss"][BAD:] == told["loss"][BAD:], f"rank {rank}, {kind}: the losses after it differ"
            assert run["lr"] == told["lr"], "the LR schedule advances through a skipped step"
        assert all(math.isfinite(x) for x in told["loss"])


def _stop_run(overrides, err_path):
    """``stem-train``'s function on ``overrides`` in this world of one (started again by the run itself), every loss
    from step 3 on not finite (the model's output times NaN); its stderr in ``err_path``. Returns its exit code."""
    import dataclasses
    import os

    from torch.distributed.elastic.utils.distributed import get_free_port

    from stem_megatron import parallel
    from stem_megatron.recipes import compose_run
    from stem_megatron.train import train
    from stem_megatron.training import loop

    setup = loop.setup_model

    def poisoned(cfg):
        trainer = setup(cfg)
        trainer.model.register_forward_hook(
            lambda module, args, out: out * float("nan") if trainer.scheduler.num_steps >= 2 else None)
        return trainer

    loop.setup_model = poisoned
    cfg = dataclasses.asdict(compose_run(overrides))
    parallel.destroy()
    os.environ["MASTER_PORT"] = str(get_free_port())
    os.dup2(os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    try:
        train(cfg)
    except SystemExit as stop:
        return stop.code
    return 0


def test_steps_not_finite_in_a_row_stop_the_run_in_one_line(corpus, tmp_path):
    """Step 2 is named by ``train.skip_steps``, steps 3 and 4 are not finite: with ``train.max_skipped_steps=2`` the
    run stops after step 4 with one line naming the step and the newest checkpoint before it (step 3's: a step told
    to skip is not one not finite), every skipped step counted in the records."""
    from runs import overrides_of

    out, err = tmp_path / "run", tmp_path / "stderr"
    overrides = overrides_of(corpus, out, "parallel=single", "train.skip_steps=[2]", "train.max_skipped_steps=2",
                             "checkpoint.save_interval=1")
    code = distributed.run(_stop_run, 1, overrides, str(err))[0]
    said = err.read_text()
    lines = [line for line in said.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert code == 1 and len(lines) == 1, said[-3000:]
    checkpoint = out / "checkpoints" / "step_000003"
    assert lines[0].startswith("error: step 4: steps 3-4 had a loss or gradients that are not finite"), lines[0]
    assert f"the last good checkpoint is {checkpoint}" in lines[0] and "lower train.lr" in lines[0], lines[0]
    assert f"checkpoint.load={checkpoint} train.skip_steps=[4])" in lines[0], lines[0]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["update_skipped"], r["skipped_steps"]) for r in records] == [
        (1, False, 0), (2, True, 1), (3, True, 2), (4, True, 3)]
    assert math.isfinite(records[1]["loss"]) and math.isnan(records[2]["loss"])


def test_a_skipped_step_is_kept_in_the_metrics(world_of_one, tmp_path):
    from stem_megatron.training.components.step_log import StepLog
    from stem_megatron.training.preemption import Decision

    cfg = RunConfig(out_dir=str(tmp_path))
    cfg.train.steps, cfg.train.log_interval = 4, 100
    with StepLog(cfg, resumed=0) as step_log:
        for step in range(1, 5):
            step_log.log({"step": step, "loss": 2.0, "lr": 1e-3, "grad_norm": None, "tokens_per_s": 1.0,
                          "loss_spike": False, "update_skipped": step == 2, "skipped_steps": int(step >= 2)},
                         Decision())
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped_steps"]) for r in written] == [(2, 1), (4, 1)]
