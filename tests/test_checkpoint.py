"""Checkpoints: exact resume (TP=2 host tables, PP=2 device tables), resume under another DP, TP or PP size,
a save killed by SIGKILL, damaged checkpoints, and the single-process export. The runs: tests/runs.py."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import distributed
import pytest
import torch
from runs import STEPS, Run, copy_stopped, overrides_of, train

from stem_megatron.checkpoint import atomic
from stem_megatron.checkpoint.atomic import CheckpointError


def _assert_same_run(a: Run, b: Run, exact=True):
    ra, rb = a.metrics, b.metrics
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(1, STEPS + 1))
    wa, wb = a.weights(), b.weights()
    assert wa.keys() == wb.keys() and any(".U_l." in k for k in wa)
    if exact:
        assert [r["loss"] for r in ra] == [r["loss"] for r in rb]
        assert [r["grad_norm"] for r in ra] == [r["grad_norm"] for r in rb]
        assert [r["lr"] for r in ra] == [r["lr"] for r in rb]
        for k in wa:
            assert torch.equal(wa[k], wb[k]), k
    else:
        for x, y in zip(ra, rb):
            assert x["loss"] == pytest.approx(y["loss"], abs=1e-4)
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], atol=1e-4, rtol=0, msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("parallel,placement,layers", [("tp2", "host", 3), ("pp2", "device", 4)])
def test_resume_equals_straight_run(runs, tmp_path, parallel, placement, layers):
    """4 steps, stop, resume 4 steps == 8 straight steps: losses, grad norms, LR and every weight
    (host-resident tables and their Adam state included) bitwise on CPU. The resumed run saves every 2 steps and
    keeps the newest 2 complete checkpoints."""
    common = [f"parallel={parallel}", f"host_tables.placement={placement}", f"model.num_layers={layers}"]
    straight = runs.shared(*common, nproc=2)
    train(runs.corpus, tmp_path, *common, "train.exit_after_steps=4", nproc=2)
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_000004"
    assert [p.name for p in atomic.complete_checkpoints(ckpts)] == ["step_000004"]
    assert not (tmp_path / "export").exists()  # the run is not finished yet
    second = train(runs.corpus, tmp_path, *common, "checkpoint.save_interval=2", nproc=2)
    assert "resumed from" in second.stdout and "after step 4" in second.stdout
    _assert_same_run(straight, second)
    assert [p.name for p in atomic.complete_checkpoints(ckpts)] == ["step_000006", "step_000008"]  # keep=2


@pytest.mark.slow
@pytest.mark.parametrize("saved,resumed,nproc,layers", [("dp2", "single", 1, 3), ("pp2", "tp2", 2, 4)])
def test_resume_under_another_layout(runs, tmp_path, saved, resumed, nproc, layers):
    """A DP=2 run (distributed optimizer) resumed on one process, and a PP=2 run resumed at PP=1 x TP=2
    (host tables split into TP column blocks), continue the same trajectory: losses and every weight and
    table row within 1e-4."""
    straight = runs.shared(f"parallel={saved}", "host_tables.placement=host", f"model.num_layers={layers}", nproc=2)
    copy_stopped(straight, 4, tmp_path)
    run = train(runs.corpus, tmp_path, f"parallel={resumed}", "host_tables.placement=host",
                f"model.num_layers={layers}", nproc=nproc)
    assert "step_000004 after step 4" in run.stdout  # continued, not started afresh at the new layout
    _assert_same_run(straight, run, exact=False)


@pytest.mark.slow
def test_resume_with_many_ddp_buckets_equals_straight_run(runs, tmp_path):
    """``parallel.ddp_bucket_size=5000``: every gradient buffer in several buckets, each padded to a multiple of
    128 elements. The distributed optimizer's state saved at DP=2 after 4 of 8 steps, resumed at DP=2 (bitwise
    the straight run: losses, grad norms, LR, every weight) and at TP=2 (within 1e-4). Without
    ``checkpoint/bucket_offsets.py`` megatron-core 0.19.2 saves each parameter after the first bucket with
    another's fp32 master and Adam moments, and the resumed runs part from the straight one. The straight run and the
    interrupted one overlap their DP communication (each bucket reduced from backward, the weights all-gathered by
    the next forward), the resumed one does not: at DP=2 each sum is of the same two numbers. Between an optimizer
    step and that forward a rank's weights are current only in its DP shard: the save at step 4 and the straight
    run's export (no checkpoint, no validation before it) gather them first."""
    common = ["parallel=dp2", "host_tables.placement=device", "model.hidden_size=120",
              "model.ffn_hidden_size=360", "parallel.ddp_bucket_size=5000"]  # not multiples of 128
    overlap = ["parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"]
    straight = train(runs.corpus, tmp_path / "straight", *common, *overlap, "train.eval_iters=0",
                     "checkpoint.save_interval=0", "checkpoint.save=false", nproc=2)
    resumed = tmp_path / "resumed"
    train(runs.corpus, resumed, *common, *overlap, "train.exit_after_steps=4", nproc=2)
    (stale,) = distributed.run(_weights_unlike_their_masters, 1, resumed / "checkpoints" / "step_000004")
    assert stale == []  # a resume alone would not show stale weights: it loads the masters over them
    shutil.copytree(resumed, tmp_path / "relaid")
    _assert_same_run(straight, train(runs.corpus, resumed, *common, nproc=2))
    relaid = train(runs.corpus, tmp_path / "relaid", "parallel=tp2", *common[1:], *overlap, nproc=2)
    _assert_same_run(straight, relaid, exact=False)


def _weights_unlike_their_masters(checkpoint: Path) -> list[str]:
    """The weights a checkpoint holds that differ from their masters in its optimizer state (fp32 on CPU: the
    same numbers when the weights are current). What ``checkpoint.init_from``, which loads weights alone, reads."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load_plain_tensors(str(checkpoint / "dense"))
    masters = {name: state.get(f"optimizer.state.param.{name}") for name in state}
    assert sum(m is not None for m in masters.values()) > 10
    return [name for name, master in masters.items() if master is not None and not torch.equal(state[name], master)]


def test_the_offsets_lent_to_the_save_skip_the_padding_between_buckets():
    """Four parameters of 100 elements in buckets padded to 256 (what megatron lays out for bucket_size=150 at
    DP=2): the gathered state has bucket 1 at 228, so its parameters move back by 28; one bucket moves nothing."""
    from stem_megatron.checkpoint.bucket_offsets import unpadded_index_map, unpadded_offsets

    a, b, c, d = (object() for _ in range(4))
    buckets = [SimpleNamespace(offset=0, numel_unpadded=228), SimpleNamespace(offset=256, numel_unpadded=228)]
    buffer = SimpleNamespace(buckets=buckets, param_index_map={a: (0, 100, 0), b: (128, 228, 0), c: (256, 356, 1),
                                                               d: (384, 484, 1)})
    assert unpadded_index_map(buffer) == {a: (0, 100, 0), b: (128, 228, 0), c: (228, 328, 1), d: (356, 456, 1)}
    assert list(unpadded_index_map(buffer)) == [a, b, c, d]  # the order megatron's load iterates
    one = SimpleNamespace(buckets=buckets[:1], param_index_map={a: (0, 100, 0), b: (128, 228, 0)})
    assert unpadded_index_map(one) == one.param_index_map
    original = buffer.param_index_map
    with unpadded_offsets(SimpleNamespace(buffers=[buffer])):
        assert buffer.param_index_map[d] == (356, 456, 1)
    assert buffer.param_index_map is original


_KILLED_SAVE = """
import os, signal
from stem_megatron.checkpoint import host_tables
from stem_megatron import train

def killed(*args):  # dense state written, tables not: die mid-save (args[-1]: the directory)
    if "step_000006" in str(args[-1]):
        os.kill(os.getpid(), signal.SIGKILL)
    real(*args)

real, host_tables.save = host_tables.save, killed
if __name__ == "__main__":  # megatron's checkpoint writer starts worker processes
    train.main()
"""


@pytest.mark.slow
def test_run_killed_mid_save_leaves_previous_checkpoint_loadable(runs, tmp_path):
    """``stem-train`` killed (SIGKILL) while it saves after step 6: the step-3 checkpoint stays the one a rerun
    resumes from, and the rerun's metrics replace the killed attempt's later steps."""
    script = tmp_path / "killed_save.py"
    script.write_text(_KILLED_SAVE)
    out = tmp_path / "run"
    setting = ("parallel=single", "checkpoint.save_interval=3")
    log = tmp_path / "killed.log"
    with open(log, "w") as out_file:  # files, not pipes: megatron's writer leaves a helper process
        proc = subprocess.Popen([sys.executable, str(script), *overrides_of(runs.corpus, out, *setting)],
                                stdout=out_file, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=600)
        finally:  # what a job scheduler does after a kill: end the whole process group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    assert returncode == -signal.SIGKILL, log.read_text()[-3000:]
    ckpts = out / "checkpoints"
    assert (ckpts / ".tmp-step_000006" / "dense").is_dir()  # the killed save got that far
    assert (ckpts / "latest").read_text().strip() == "step_000003"
    resumed = train(runs.corpus, out, *setting)
    assert "after step 3" in resumed.stdout
    assert [r["step"] for r in resumed.metrics] == list(range(1, STEPS + 1))  # the killed attempt's 4..6 replaced
    assert (ckpts / "latest").read_text().strip() == f"step_{STEPS:06d}"
    assert not (ckpts / ".tmp-step_000006").exists()  # leftovers are not kept around


def _damage(checkpoint: Path, how: str) -> str:
    victim = next(p for p in sorted(checkpoint.rglob("*")) if p.is_file() and p.suffix == ".distcp")
    data = victim.read_bytes()
    if how == "truncate":
        victim.write_bytes(data[: len(data) // 2])
        return "truncated"
    victim.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    return "CRC32"


DAMAGED = ("parallel=single", "model.num_layers=2", "checkpoint.fallback=false")


@pytest.fixture(scope="module")
def saved_run(runs, tmp_path_factory):
    """A run that saved after step 4, trained once for every kind of damage done to copies of it."""
    return train(runs.corpus, tmp_path_factory.mktemp("saved") / "run", *DAMAGED, "train.exit_after_steps=4").out_dir


@pytest.mark.slow
@pytest.mark.parametrize("how,launch", [("truncate", "stem-train"), ("flip", "in-process")])
def test_damaged_checkpoint_is_reported_and_not_loaded(runs, saved_run, tmp_path, how, launch):
    """checkpoint.fallback=false: a damaged checkpoint stops the run, naming the file and the damage, in one line
    (``stem-train`` itself, and its function as tests/runs.py runs it)."""
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    expected = _damage(out / "checkpoints" / "step_000004", how)
    if launch == "stem-train":
        proc = subprocess.run([sys.executable, "-m", "stem_megatron.train", *overrides_of(runs.corpus, out, *DAMAGED)],
                              capture_output=True, text=True, timeout=600)
    else:
        proc = train(runs.corpus, out, *DAMAGED, check=False)
    assert proc.returncode == 1 and "stem_megatron/" not in proc.stderr, proc.stderr[-3000:]  # no traceback of ours
    assert f"error: checkpoint {out / 'checkpoints' / 'step_000004'} is damaged" in proc.stderr
    assert expected in proc.stderr and ".distcp" in proc.stderr
    assert (out / "checkpoints" / "step_000004").is_dir()  # nothing saved is deleted


@pytest.mark.slow
def test_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(runs, tmp_path):
    """A requeued job whose newest checkpoint is damaged reports it, resumes from the newest intact one and
    trains the same losses as an uninterrupted run; the damaged checkpoint stays on disk until replaced."""
    straight = runs.shared("parallel=single")
    copy_stopped(straight, STEPS, tmp_path)
    _damage(tmp_path / "checkpoints" / f"step_{STEPS:06d}", "flip")
    run = train(runs.corpus, tmp_path, "parallel=single")
    assert f"checkpoint {tmp_path / 'checkpoints' / f'step_{STEPS:06d}'} is damaged" in run.stderr
    assert "resumed from" in run.stdout and "step_000004 after step 4" in run.stdout
    assert [r["loss"] for r in run.metrics] == [r["loss"] for r in straight.metrics]
    assert [r["step"] for r in run.metrics] == list(range(1, STEPS + 1))


def _resolve_cases(root):
    assert atomic.resolve(root) is None  # fresh run
    (root / "step_000004").mkdir(parents=True)
    (root / "step_000004" / atomic.MANIFEST).write_text("{}")
    with pytest.raises(CheckpointError, match="no 'latest' marker"):
        atomic.resolve(root)
    (root / "latest").write_text("step_000008\n")
    with pytest.raises(CheckpointError, match="names step_000008, which is missing"):
        atomic.resolve(root)
    (root / "latest").write_text("step_000004\n")
    assert atomic.resolve(root) == root / "step_000004"
    with pytest.raises(CheckpointError, match="manifest.json is unreadable"):
        atomic.verify(root / "step_000004")
    return True


def test_latest_marker_resolution_and_errors(tmp_path):
    assert distributed.run(_resolve_cases, 1, tmp_path / "ckpts") == [True]


def test_missing_load_path_fails_validation(tmp_path):
    from stem_megatron.config import CheckpointConfig, ConfigError, RunConfig, validate

    cfg = RunConfig(checkpoint=CheckpointConfig(load=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match="checkpoint.load: .*nope does not exist"):
        validate(cfg, 1)


def test_a_checkpoint_loads_under_another_layout_except_across_ep_1():
    from stem_megatron.checkpoint import manager
    from stem_megatron.config import RunConfig

    cfg = RunConfig()
    manifest = {**manager._identity(cfg), "layout": {"world": 8, "tp": 2, "pp": 2, "ep": 2, "dp": 2}}
    manager._check_compatible(cfg, manifest, Path("ckpt"), {"world": 4, "tp": 1, "pp": 1, "ep": 4, "dp": 4})
    with pytest.raises(CheckpointError, match="saved with EP=2 and this run has EP=1: .*Resume with EP > 1"):
        manager._check_compatible(cfg, manifest, Path("ckpt"), {"world": 1, "tp": 1, "pp": 1, "ep": 1, "dp": 1})


def test_a_setting_added_after_the_save_counts_as_its_default_and_a_changed_one_is_refused():
    """A checkpoint from before ``clip`` (now ``host_tables.clip``) existed trained with today's default (global); a
    run with separate clipping, or another STEM variant, does not continue it, and the error names today's key.
    ``host_tables.overlap_exchange`` changes no result and is not compared."""
    from stem_megatron.checkpoint import manager
    from stem_megatron.config import HostTablesConfig, RunConfig, STEMConfig

    layout = {"world": 1, "tp": 1, "pp": 1, "ep": 1, "dp": 1}
    old = {**manager._identity(RunConfig()), "layout": layout}
    del old["stem"]["clip"]
    manager._check_compatible(RunConfig(host_tables=HostTablesConfig(overlap_exchange=False)), old, Path("ckpt"),
                              layout)
    for cfg, key in ((RunConfig(host_tables=HostTablesConfig(clip="separate")), "host_tables.clip"),
                     (RunConfig(stem=STEMConfig(variant="stem_gate")), "stem.variant")):
        with pytest.raises(CheckpointError, match=f"different stem config \\({key}: .*resume with the "
                                                  f"checkpoint's settings"):
            manager._check_compatible(cfg, old, Path("ckpt"), layout)


def test_metrics_of_a_resumed_run_continue_and_a_fresh_run_starts_a_new_file(tmp_path):
    from stem_megatron.training.metrics_file import MetricsWriter

    def write(steps, resume_step=0):
        writer = MetricsWriter(tmp_path, True, 9, resume_step=resume_step)
        for step in steps:
            writer.log({"step": step, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "tokens_per_s": 1.0})
        writer.close()

    write(range(1, 8))  # killed after step 7, checkpoint at step 5
    write(range(6, 10), resume_step=5)
    assert [r["step"] for r in Run(tmp_path).metrics] == list(range(1, 10))
    write(range(1, 3))  # a new run in the same directory
    assert [r["step"] for r in Run(tmp_path).metrics] == [1, 2]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.1.jsonl").read_text().splitlines()] == list(
        range(1, 10))
