"""A run directory holds one job at a time and is writable with room for a checkpoint before step 1
(training/run_dir.py); a job under ``python -m stem_megatron.torchrun`` ends with its failing rank's one line, and no
process of it remains however a rank dies (stem_megatron/child_processes.py)."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from runs import overrides_of, train
from torch.distributed.elastic.utils.distributed import get_free_port

from stem_megatron.config import ConfigError
from stem_megatron.training.run_dir import RunLock, check_room, checkpoint_bytes


def _in_use(out_dir) -> str:
    """The refusal while this process holds ``out_dir``."""
    return (f"out_dir: {out_dir} is in use by another job (host {socket.gethostname()}, pid {os.getpid()}; its lock: "
            f"{out_dir}/.lock): wait for it to end, or give this run another out_dir")


def test_a_second_job_on_a_run_directory_is_refused_on_every_rank(corpus, tmp_path):
    """The lock held here: a second holder is refused naming this process, and a 2-rank run on the directory ends on
    both ranks with that line before any process group starts; released, the directory is free again."""
    out = tmp_path / "run"
    held = RunLock(out)
    with pytest.raises(ConfigError) as refused:
        RunLock(out)
    assert str(refused.value) == _in_use(out)
    run = train(corpus, out, "parallel=dp2", nproc=2, check=False)
    assert run.returncode == 1
    assert sorted(run.stderr.splitlines()) == [f"[rank {r}] error: {_in_use(out)}" for r in (0, 1)], run.stderr
    held.release()
    RunLock(out).release()


def test_the_lock_ends_with_its_holder_not_with_a_child_it_forked(tmp_path):
    """A holder killed by SIGKILL, its forked child alive (as a rank's checkpoint writer can outlive it): the
    directory is free for the next job (a requeue)."""
    out = tmp_path / "run"
    script = textwrap.dedent(f"""
        import os, signal, time
        from pathlib import Path
        from stem_megatron.training.run_dir import RunLock
        RunLock(Path({str(out)!r}))
        child = os.fork()
        if child == 0:
            for fd in (1, 2):  # the test reads the holder's output to its end
                os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
            time.sleep(60)
            os._exit(0)
        print(child, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """)
    holder = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    child = int(holder.stdout)
    try:
        assert holder.returncode == -signal.SIGKILL and Path(f"/proc/{child}").exists()
        RunLock(out).release()
    finally:
        os.kill(child, signal.SIGKILL)


def test_unwritable_directories_and_a_full_checkpoint_filesystem_are_refused(corpus, tmp_path, monkeypatch):
    """Each in one line naming the setting that moves it: the checkpoint and data-cache directories (here under a
    file, which no user can write), and a checkpoint filesystem with less room than a checkpoint."""
    from stem_megatron.recipes import compose_run

    blocker = tmp_path / "file"
    blocker.write_text("")

    def refusal(*overrides):
        with pytest.raises(ConfigError) as refused:
            check_room(compose_run(overrides_of(corpus, tmp_path / "run", *overrides)))
        return str(refused.value)

    assert refusal(f"checkpoint.dir={blocker}/ckpt") == (
        f"checkpoint.dir: {blocker}/ckpt is not writable (Not a directory): give checkpoint.dir a directory this job "
        f"can write")
    assert refusal(f"data.cache_dir={blocker}/cache") == (
        f"data.cache_dir: {blocker}/cache is not writable (Not a directory), and megatron builds the dataset indices "
        f"there: set data.cache_dir to a directory every rank sees and this job can write")
    monkeypatch.setattr("shutil.disk_usage", lambda path: SimpleNamespace(free=2**20))
    cfg = compose_run(overrides_of(corpus, tmp_path / "run"))
    said = refusal()
    assert said.startswith(f"checkpoint.dir: {tmp_path}/run/checkpoints (filesystem /") and said.endswith(
        f") has 1.0 MiB free, and a checkpoint of this run takes about {checkpoint_bytes(cfg) / 2**20:.1f} MiB "
        f"(weights, Adam state, STEM tables): free space there, or set checkpoint.dir on a larger one"), said


def test_a_failed_rank_s_line_ends_the_job(tmp_path, monkeypatch, capfd):
    """A rank's refusal (``stem_megatron.train.report``) is also torchrun's error file, whose message the launcher
    prints last with the rank's exit code; else a rank ended by a signal is named, with 128 + the signal."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from stem_megatron.torchrun import failure_line
    from stem_megatron.train import report

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "rank1" / "error.json"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    report(ConfigError("train.steps: must be >= 1"))
    assert capfd.readouterr().err == "[rank 1] error: train.steps: must be >= 1\n"
    refused = ProcessFailure(local_rank=1, pid=12, exitcode=1, error_file=str(tmp_path / "rank1" / "error.json"))
    killed = ProcessFailure(local_rank=0, pid=11, exitcode=-signal.SIGKILL, error_file=str(tmp_path / "none.json"))
    assert failure_line(ChildFailedError("train", {1: refused})) == ("[rank 1] error: train.steps: must be >= 1", 1)
    crashed = ProcessFailure(local_rank=1, pid=12, exitcode=1, error_file=str(tmp_path / "none.json"))
    assert failure_line(ChildFailedError("train", {1: crashed, 0: killed})) == (
        "torchrun: rank 0 (pid 11) ended on SIGKILL", 137)  # whose end made rank 1 fail (the same second)
    assert failure_line(ChildFailedError("train", {0: killed, 1: refused})) == (
        "[rank 1] error: train.steps: must be >= 1", 1)
    # both said their line; torchrun stopped rank 0 (SIGTERM) once rank 1 had exited with its own
    stopped = ProcessFailure(local_rank=0, pid=11, exitcode=-signal.SIGTERM, error_file=str(tmp_path / "rank1" /
                                                                                           "error.json"))
    assert failure_line(ChildFailedError("train", {0: stopped, 1: refused})) == (
        "[rank 1] error: train.steps: must be >= 1", 1)
    assert failure_line(ChildFailedError("train", {0: stopped}))[1] == 128 + signal.SIGTERM


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_checkpoint_writer_s_manager_dies_with_its_rank(method, tmp_path):
    """megatron's results manager as the checkpoint writer starts it (forked on CPU under
    ``dies_with_this_process``; spawned where CUDA is up, importing the training module): SIGKILL of the rank, without
    a launcher, ends it too."""
    script = textwrap.dedent(f"""
        import multiprocessing as mp, os, signal, sys
        if {method!r} == "spawn":
            import stem_megatron.train as entry
            sys.modules["__main__"] = entry  # as under torchrun's -m stem_megatron.train
        from stem_megatron.child_processes import dies_with_this_process
        with dies_with_this_process():
            manager = mp.get_context({method!r}).Manager()
            queue = manager.Queue()
        print(manager._process.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """)
    with open(tmp_path / "out", "w") as out:  # a file, not a pipe: a manager left alive would hold it open
        subprocess.run([sys.executable, "-c", script], stdout=out, timeout=120)
    manager = int((tmp_path / "out").read_text())
    try:
        assert _ends_within(manager, 10), f"{method}ed manager {manager} outlived its rank"
    finally:
        if _alive(manager):
            os.kill(manager, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running or sleeping, not a zombie (an ended child its new parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _ends_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _tree(root: int) -> dict[int, dict]:
    """Every process below ``root``: pid -> its environment's RANK (None: not a rank) and parent."""
    from stem_megatron.child_processes import children

    found, todo = {}, [root]
    while todo:
        parent = todo.pop()
        for pid in children(parent):
            try:
                env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
            except OSError:
                continue
            found[pid] = {"rank": env.get("RANK"), "parent": parent}
            todo.append(pid)
    return found


@pytest.mark.slow
def test_a_rank_killed_mid_run_leaves_no_process_behind(corpus, tmp_path):
    """TP=2 under the launcher, each rank's checkpoint writer up after the first save: SIGKILL of rank 1 ends the
    job with its one line and 128 + 9, no process of the job remains, the directory is free for the requeue, and
    the saved checkpoint is the size ``run_dir.checkpoint_bytes`` plans for (within 10 %)."""
    from stem_megatron.recipes import compose_run

    out = tmp_path / "run"
    overrides = overrides_of(corpus, out, "parallel=tp2", "train.steps=1000", "checkpoint.save_interval=1",
                             "train.eval_interval=0")
    log = open(tmp_path / "stderr", "w+")  # a file, not a pipe: a process left alive would hold it open
    agent = subprocess.Popen([sys.executable, "-m", "stem_megatron.torchrun", "--nproc_per_node=2",
                              "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{get_free_port()}", "-m",
                              "stem_megatron.train", *overrides], stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoints" / "latest").exists() and agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        tree = _tree(agent.pid)
        ranks = {info["rank"]: pid for pid, info in tree.items() if info["parent"] == agent.pid}
        assert set(ranks) == {"0", "1"}, (tree, agent.poll())
        writers = [pid for pid, info in tree.items() if info["parent"] in ranks.values()]
        assert len(writers) >= 2, tree  # a manager under each rank
        os.kill(ranks["1"], signal.SIGKILL)
        agent.wait(timeout=300)
    finally:
        if agent.poll() is None:
            agent.kill()
        log.close()
    err = (tmp_path / "stderr").read_text()
    left = [pid for pid in tree if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the job left: {left}"
    assert agent.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert err.splitlines()[-1] == f"torchrun: rank 1 (pid {ranks['1']}) ended on SIGKILL", err[-3000:]
    assert "ChildFailedError" not in err, err[-3000:]  # rank 0 may say its peer's end, torchrun adds no traceback
    RunLock(out).release()
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    saved = sum(f.stat().st_size for f in latest.rglob("*") if f.is_file())
    assert abs(saved / checkpoint_bytes(compose_run(overrides)) - 1) < 0.1, saved
