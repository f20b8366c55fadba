"""The run directory before any process group starts: one job at a time, and room for what the run writes.

Global rank 0 takes an advisory lock on ``<out_dir>/.lock`` (``fcntl.flock``; the file says the holder's host and
pid) and keeps it for the run: a second job on the directory refuses instead of dying at its first save in a race
with the first, or saving steps into the same checkpoints. The kernel releases the lock when its holder dies, so a
requeued job (SLURM after a node failure) goes on; the children a rank forks (megatron's checkpoint writer) close
their copy, so one that outlives its rank does not hold it.

With the lock rank 0 checks that the run, checkpoint and data-cache directories are writable (a probe file each) and
that the checkpoint filesystem holds a checkpoint (``checkpoint_bytes``), so a directory it cannot write is found
before step 1, not at the first save hours in. Its outcome reaches every rank through torchrun's rendezvous store
(the one ``init_process_group`` joins next), so every rank ends with the same one line.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Iterator, Optional

from stem_megatron.config import ConfigError, RunConfig, validate

LOCK = ".lock"
_held: set[int] = set()  # the lock's descriptor in this process, closed in every forked child


def _close_in_child() -> None:
    for fd in _held:
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


class RunLock:
    """An exclusive lock on ``out_dir`` (``<out_dir>/.lock``) while this object holds it."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / LOCK
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"out_dir: {out_dir} is not writable ({e.strerror}): give the run a directory this job "
                              f"can write") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 200, 0).decode(errors="replace").strip() or "a holder that has not said who"
            os.close(self._fd)
            raise ConfigError(f"out_dir: {out_dir} is in use by another job ({holder}; its lock: {self.path}): wait "
                              f"for it to end, or give this run another out_dir") from None
        except OSError as e:  # a filesystem without flock, e.g. Lustre mounted without -o flock
            print(f"warning: out_dir: {self.path} cannot be locked ({e.strerror}): a second job on this directory "
                  f"goes unnoticed", flush=True)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"host {socket.gethostname()}, pid {os.getpid()}\n".encode(), 0)
        _held.add(self._fd)

    def release(self) -> None:
        _held.discard(self._fd)
        os.close(self._fd)


def checkpoint_bytes(cfg: RunConfig) -> int:
    """A checkpoint's size: each dense parameter's weight (bf16 on GPU, fp32 on CPU) and megatron's Adam state (fp32
    main parameter and two moments, saved once in model space whatever the layout), and each host STEM table's fp32
    master rows and two moments (``checkpoint/host_tables.py``)."""
    import torch

    from stem_megatron.flops.layout import Layout
    from stem_megatron.flops.memory import host_stem_layers, rank_parameters

    whole = replace(cfg, parallel=replace(cfg.parallel, expert_model_parallel_size=1))
    parameters, _ = rank_parameters(whole, Layout(gpus_per_node=1), stage=0)
    tables = len(host_stem_layers(cfg, 1, 0)) * cfg.model.vocab_size * cfg.model.ffn_hidden_size
    return parameters * ((2 if torch.cuda.is_available() else 4) + 12) + tables * 12


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _writable(directory: Path) -> Optional[str]:
    """Why this job cannot write ``directory`` (made if missing), or None: a probe file made and removed."""
    probe = directory / f".probe-{socket.gethostname()}-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        probe.unlink()
    except OSError as e:
        return e.strerror
    return None


def check_room(cfg: RunConfig) -> None:
    """ConfigError naming the directory (and the setting that moves it) this job cannot write, or a checkpoint
    filesystem without room for one checkpoint."""
    from stem_megatron.checkpoint.disk import mount_point
    from stem_megatron.checkpoint.manager import root_dir

    if cfg.checkpoint.save:
        checkpoints = root_dir(cfg)
        why = _writable(checkpoints)
        if why:
            raise ConfigError(f"checkpoint.dir: {checkpoints} is not writable ({why}): give checkpoint.dir a "
                              f"directory this job can write")
        need, free = checkpoint_bytes(cfg), shutil.disk_usage(checkpoints).free
        if free < need:
            raise ConfigError(f"checkpoint.dir: {checkpoints} (filesystem {mount_point(checkpoints)}) has "
                              f"{_size(free)} free, and a checkpoint of this run takes about {_size(need)} (weights, "
                              f"Adam state, STEM tables): free space there, or set checkpoint.dir on a larger one")
    cache = Path(cfg.data.cache_dir or Path(cfg.data.dir) / "index_cache")
    why = _writable(cache)
    if why and not (cache.is_dir() and any(cache.iterdir())):  # a cache built before is only read
        raise ConfigError(f"data.cache_dir: {cache} is not writable ({why}), and megatron builds the dataset indices "
                          f"there: set data.cache_dir to a directory every rank sees and this job can write")


def _from_rank0(problem: Optional[str]) -> tuple[Optional[str], object]:
    """Rank 0's ``problem`` (None: none) on every rank, through the rendezvous store ``init_process_group`` joins next
    (torchrun's agent's, or rank 0's, which init reuses: ``multi_tenant``); the store is returned to be kept alive
    until then. With a problem rank 0 waits until every rank has read it: its exit would end the store (its own) or
    the job (the agent's) before they say it too."""
    from torch.distributed import TCPStore

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ["WORLD_SIZE"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=rank == 0 and not agent,
                     timeout=timedelta(minutes=10), wait_for_workers=False, multi_tenant=True)
    key = f"stem_megatron/run_dir/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
    if rank != 0:
        problem = store.get(key).decode() or None
        store.set(f"{key}/read/{rank}", "")
        return problem, store
    store.set(key, problem or "")
    if problem:
        with contextlib.suppress(RuntimeError):  # a rank that never came: say it here all the same
            store.wait([f"{key}/read/{r}" for r in range(1, world)])
    return problem, store


@contextlib.contextmanager
def claimed(cfg: RunConfig) -> Iterator[None]:
    """The run directory held by this job while the block runs (every rank enters it, before any process group);
    ConfigError on every rank, with rank 0's line, where the config is invalid (``validate``), the directory is
    another job's, or a directory cannot be written or hold a checkpoint."""
    lock, problem, world = None, None, int(os.environ.get("WORLD_SIZE", 1))
    if int(os.environ.get("RANK", 0)) == 0:
        try:
            validate(cfg, world)  # first: a directory below may be a setting's typo
            lock = RunLock(Path(cfg.out_dir))
            check_room(cfg)
        except ConfigError as e:
            problem = str(e)
    store = None
    if world > 1:
        problem, store = _from_rank0(problem)
    try:
        if problem:
            raise ConfigError(problem)
        yield
    finally:
        del store
        if lock is not None:
            lock.release()
