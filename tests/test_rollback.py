"""Checkpoints over a long run: a resume with a new schedule and optimizer settings, a rollback to an earlier
checkpoint of the run, retention that keeps ``latest``, no silent restart beside checkpoints none of which is intact,
no checkpoint sealed with a NaN or inf, and a full disk named in one line. The runs: tests/runs.py."""

import errno
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import runs as launches
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from runs import _rank as _train_rank
from runs import copy_stopped, overrides_of, train

from stem_megatron.checkpoint import atomic, dense, manager
from stem_megatron.checkpoint.atomic import CheckpointError
from stem_megatron.config import RunConfig

TP2 = ("parallel=tp2", "host_tables.placement=host")


def _schedule(cfg) -> list[float]:
    """The lr of each step of ``cfg``'s run (step s runs at the schedule's value after s - 1 steps)."""
    from stem_megatron.training.optim import build_scheduler

    scheduler = build_scheduler(SimpleNamespace(param_groups=[{}]), cfg.train)
    lrs = []
    for _ in range(cfg.train.steps):
        lrs.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.step(1)
    return lrs


@pytest.mark.slow
def test_a_resume_with_a_new_lr_betas_and_decay_follows_them_from_the_resumed_step(runs, tmp_path):
    """TP=2, host tables: stopped after step 4 at lr 3e-3, resumed with lr 1e-3, beta2 0.99, weight decay 0.05: steps
    5..8 run at the new schedule's lr, step 5's loss (the weights of step 4) is the straight run's, and the optimizer's
    param groups the run saves hold the new betas and decay. Left to itself megatron-core 0.19.2 refuses the load
    (KeyError: it keys param groups by their max_lr and min_lr) and its scheduler takes the checkpoint's schedule."""
    from megatron.core import dist_checkpointing

    from stem_megatron.recipes import compose_run

    straight = runs.shared(*TP2, nproc=2)
    copy_stopped(straight, 4, tmp_path)
    changed = ("train.lr=1e-3", "train.adam_beta2=0.99", "train.weight_decay=0.05")
    run = train(runs.corpus, tmp_path, *TP2, *changed, nproc=2)
    assert ("after step 4; from step 5: train.lr 0.003 -> 0.001, train.weight_decay 0.1 -> 0.05, train.adam_beta2 "
            "0.95 -> 0.99") in run.stdout
    lrs = [r["lr"] for r in run.metrics]
    assert lrs[:4] == [r["lr"] for r in straight.metrics][:4]
    assert lrs[4:] == _schedule(compose_run(overrides_of(runs.corpus, tmp_path, *TP2, *changed)))[4:]
    assert lrs[4] != straight.metrics[4]["lr"]
    assert run.metrics[4]["loss"] == straight.metrics[4]["loss"] != run.metrics[5]["loss"]
    saved = dist_checkpointing.load_common_state_dict(str(tmp_path / "checkpoints" / "step_000008" / "dense"))
    groups = saved["optimizer"]["optimizer"]["param_groups"]
    assert {(g["max_lr"], g["betas"], g["weight_decay"]) for g in groups} == {(1e-3, (0.9, 0.99), 0.05),
                                                                             (1e-3, (0.9, 0.99), 0.0)}


@pytest.mark.slow
def test_a_rollback_continues_from_the_named_checkpoint_and_retention_keeps_latest(runs, tmp_path):
    """A run with checkpoints at steps 4 and 8 rolled back to step 4 (``checkpoint.load``), saving after steps 5 and 6
    with ``keep=1, keep_every=4``: it trains the straight run's steps 5 and 6, and keeps step 6 (latest), step 4 (a
    milestone) and step 8 (the abandoned branch, after latest); step 5 goes. Retention by step number alone deletes
    latest."""
    straight = runs.shared("parallel=single")
    shutil.copytree(straight.out_dir, tmp_path, ignore=shutil.ignore_patterns("export"), dirs_exist_ok=True)
    root = tmp_path / "checkpoints"
    run = train(runs.corpus, tmp_path, "parallel=single", f"checkpoint.load={root / 'step_000004'}",
                "checkpoint.save_interval=1", "checkpoint.keep=1", "checkpoint.keep_every=4",
                "train.exit_after_steps=2")
    assert [p.name for p in atomic.complete_checkpoints(root)] == ["step_000004", "step_000006", "step_000008"]
    assert (root / "latest").read_text() == "step_000006\n"
    assert f"checkpoint.load={root / 'step_000004'} rolls this run back from step_000008" in run.stderr
    assert [r["step"] for r in run.metrics] == list(range(1, 7))
    assert [r["loss"] for r in run.metrics] == [r["loss"] for r in straight.metrics][:6]


def _seal(root: Path, step: int, keep: int = 0, keep_every: int = 0) -> None:
    staging = atomic.staging_dir(root, step)
    (staging / "part").write_text(str(step))
    atomic.commit(staging, step, {}, keep, keep_every)


def test_retention_counts_the_checkpoints_up_to_latest(world_of_one, tmp_path):
    """A new start (``checkpoint.resume=false``) or a rollback saving step 4 again beside steps 2, 4, 6, 8: step 4 is
    replaced and latest, step 2 goes (keep=1), 6 and 8 stay; at step 5 with keep_every=4, step 4 stays, a
    milestone."""
    for step in (2, 4, 6, 8):
        _seal(tmp_path, step)
    _seal(tmp_path, 4, keep=1)
    assert [p.name for p in atomic.complete_checkpoints(tmp_path)] == ["step_000004", "step_000006", "step_000008"]
    _seal(tmp_path, 5, keep=1, keep_every=4)
    assert atomic.latest_name(tmp_path) == "step_000005"
    assert [p.name for p in atomic.complete_checkpoints(tmp_path)] == [f"step_00000{s}" for s in (4, 5, 6, 8)]


def test_checkpoints_none_of_which_is_intact_stop_the_run(world_of_one, tmp_path, capsys):
    """Checkpoint directories whose manifests are gone, with or without ``latest``: the run stops in one line naming
    them and the ways out, rather than start over at step 1 (with rc 0, saving over them). ``checkpoint.resume=false``
    starts over, saying so and deleting nothing; an unfinished first save alone is no checkpoint."""
    cfg = RunConfig(out_dir=str(tmp_path))
    root = tmp_path / "checkpoints"
    (root / "step_000004" / "dense").mkdir(parents=True)
    (root / ".tmp-step_000008").mkdir()
    (root / "latest").write_text("step_000004\n")
    refusal = (f"{root} holds .tmp-step_000008, latest, step_000004 and no intact checkpoint (none has its "
               f"manifest.json): this run would start over at step 1 and save over them. Resume from a checkpoint "
               f"with checkpoint.load=<step dir>, or start over with checkpoint.resume=false (nothing there is "
               f"deleted; each save replaces the step_* directory of its number)")
    with pytest.raises(CheckpointError) as refused:
        manager.find(cfg)
    assert str(refused.value) == refusal
    (root / "latest").unlink()
    for fallback in (True, False):  # checkpoint.fallback=false refused a latest naming nothing already
        cfg.checkpoint.fallback = fallback
        with pytest.raises(CheckpointError, match="holds .tmp-step_000008, step_000004 and no intact checkpoint"):
            manager.find(cfg)
    cfg.checkpoint.resume = False
    capsys.readouterr()
    assert manager.find(cfg) is None
    assert "checkpoint.resume=false: starting at step 1 beside .tmp-step_000008, step_000004" in capsys.readouterr().err
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step_000008", "step_000004"]
    cfg.checkpoint.resume = True
    shutil.rmtree(root / "step_000004")
    assert manager.find(cfg) is None
    assert "holds only .tmp-step_000008, an unfinished save" in capsys.readouterr().err


def test_a_resume_may_not_change_the_global_batch_or_the_seed():
    """The data position is the step: another global batch or seed would skip or repeat samples."""
    layout = {"world": 1, "tp": 1, "pp": 1, "ep": 1, "dp": 1}
    saved = RunConfig()
    manifest = {**manager._identity(saved), "layout": layout, "train": dict(vars(saved.train))}
    changed = RunConfig()
    changed.train.lr, changed.train.steps = 1e-4, 99
    manager._check_compatible(changed, manifest, Path("ckpt"), layout)
    assert manager.changes(changed, manifest) == ["train.steps 50 -> 99", "train.lr 0.002 -> 0.0001"]
    changed.train.global_batch_size = 16
    with pytest.raises(CheckpointError, match=r"trained with train.global_batch_size=8 and this run has "
                                              r"train.global_batch_size=16: the data position is the step"):
        manager._check_compatible(changed, manifest, Path("ckpt"), layout)


def test_nonfinite_values_are_found_and_a_sum_past_the_float_range_is_not_one():
    from stem_megatron.checkpoint import finite

    tensors = [("big", torch.full((4,), 3e38)), ("nan", torch.tensor([1.0, float("nan")])),
               ("inf", torch.tensor([-float("inf"), 0.0], dtype=torch.bfloat16)), ("ok", torch.ones(3, 3))]
    assert finite.nonfinite(tensors) == ["nan", "inf"]


def test_a_checkpoint_holding_nan_or_inf_is_never_sealed(world_of_one, tmp_path, monkeypatch):
    """A stand-in state (dense weights and optimizer moments, host tables) with a NaN in a moment and an inf in a table:
    the save fails in one line naming them, writes nothing, and the earlier checkpoint stays latest. A NaN in a
    replica another rank writes is that rank's to find."""
    cfg = RunConfig(out_dir=str(tmp_path))
    root = tmp_path / "checkpoints"
    _seal(root, 4)
    moment = torch.zeros(4, 4)
    moment[1, 2] = float("nan")
    weights = {"w": ShardedTensor.from_rank_offsets("decoder.w", torch.ones(4, 4)),
               "m": ShardedTensor.from_rank_offsets("optimizer.state.exp_avg.decoder.w", moment),
               "r": ShardedTensor.from_rank_offsets("decoder.r", moment.clone(), replica_id=1)}
    table = torch.zeros(8, 4)
    table[7, 0] = float("inf")
    tables = SimpleNamespace(hosted=True, sharded_state_dict=lambda: {
        "L2.weight": ShardedTensor.from_rank_offsets("stem.L2.weight.by_owner", table)})
    monkeypatch.setattr(dense, "state", lambda model, optimizer: weights)
    monkeypatch.setattr(dense, "write", lambda *args: pytest.fail("a non-finite checkpoint was written"))
    trainer = SimpleNamespace(model=None, optimizer=SimpleNamespace(dense=None, tables=tables), scheduler=None)
    with pytest.raises(CheckpointError) as refused:
        manager.save(cfg, trainer, None, 5)
    assert str(refused.value) == (
        f"checkpoint after step 5 not saved: 2 tensor(s) hold NaN or inf (optimizer.state.exp_avg.decoder.w, "
        f"stem.L2.weight.by_owner); {root / 'latest'} stays step_000004: resume from it (checkpoint.load="
        f"{root / 'step_000004'}) with a lower train.lr, or skip the batches that broke it (train.skip_steps)")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000004"]
    assert atomic.latest_name(root) == "step_000004"


class _Wrapped(RuntimeError):
    """torch's CheckpointException keeps each rank's failure as (exception, traceback) in ``failures``."""

    def __init__(self, failure):
        super().__init__("write failed")
        self.failures = {0: (failure, "traceback")}


def test_a_save_that_fails_for_space_quota_or_access_is_named(tmp_path):
    from stem_megatron.checkpoint import disk

    size, free = 10**6, shutil.disk_usage(tmp_path).free
    line = disk.failure(_Wrapped(OSError(errno.EDQUOT, "quota")), tmp_path / "ckpts", 5, size, "step_000004")
    mount = disk.mount_point(tmp_path)
    assert line.startswith(f"checkpoint after step 5 not saved: EDQUOT (Disk quota exceeded) writing {tmp_path}/ckpts"
                           f", on the filesystem mounted at {mount}: ")
    assert line.endswith(f"bytes free, the checkpoint needs 1,000,000. Its partial directory is removed and "
                         f"{tmp_path}/ckpts/latest stays step_000004; free space there (or quota) or set "
                         f"checkpoint.dir to another filesystem, then rerun: it resumes from step_000004")
    try:
        raise RuntimeError("unexpected pos 704 vs 598") from PermissionError(errno.EACCES, "denied")
    except RuntimeError as error:
        assert "EACCES (Permission denied)" in disk.failure(error, tmp_path, 5, size, None)
    assert disk.failure(RuntimeError("unexpected pos 704 vs 598"), tmp_path, 5, size, None) is None
    assert "ENOSPC" in disk.failure(RuntimeError("unexpected pos 704 vs 598"), tmp_path, 5, free + 1, None)


def _full_disk_rank(*args):
    """``runs._rank`` on a disk that fills at the save after step 5: megatron's writer cannot open its files (ENOSPC),
    and from then on the filesystem of the checkpoints says 1 block free, as a full one does."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    statvfs, filled = os.statvfs, []

    def full_open(path, *more, **kwargs):
        if "step_000005" in str(path):
            filled.append(path)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return open(path, *more, **kwargs)

    def full(path):
        real = statvfs(path)
        return os.statvfs_result((*real[:3], 1, 1, *real[5:])) if filled and "checkpoints" in str(path) else real

    filesystem_async.open, os.statvfs = full_open, full
    _train_rank(*args)


@pytest.mark.slow
def test_a_full_disk_ends_the_run_in_one_line_and_latest_stays(runs, tmp_path, monkeypatch):
    """The save after step 5 on a full disk: megatron's writer reports it without its errno, the filesystem tells; the
    run ends with one line (no traceback) naming ENOSPC, the mount point, the free bytes and the checkpoint's size,
    the partial directory is gone, and step 4 stays latest."""
    from stem_megatron.checkpoint import disk

    copy_stopped(runs.shared("parallel=single"), 4, tmp_path)
    monkeypatch.setattr(launches, "_rank", _full_disk_rank)
    run = train(runs.corpus, tmp_path, "parallel=single", "train.exit_after_steps=1", check=False)
    root = tmp_path / "checkpoints"
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 1 and "stem_megatron/" not in run.stderr, run.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: checkpoint after step 5 not saved: ENOSPC (No space left on device) writing {root}, on the "
        f"filesystem mounted at {disk.mount_point(root)}: {os.statvfs(root).f_frsize:,} bytes free, the checkpoint "
        f"needs "), errors
    assert errors[0].endswith(f"{root / 'latest'} stays step_000004; free space there (or quota) or set "
                              f"checkpoint.dir to another filesystem, then rerun: it resumes from step_000004")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000004"]
    assert atomic.latest_name(root) == "step_000004"
