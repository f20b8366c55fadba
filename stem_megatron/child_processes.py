"""No process outlives its run, however a rank dies.

A rank's children end with it by Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``): megatron's
checkpoint writer returns its results through a ``multiprocessing`` manager process made at a rank's first save,
forked on CPU (``checkpoint/dense.py``: ``dies_with_this_process`` around its start) and spawned where CUDA is up (a
spawned child imports the training module, ``stem_megatron.train``, as ``__mp_main__``, which calls
``die_with_parent``). Killed by SIGKILL, a rank runs no cleanup; without the signal its manager lived on under init.

What a rank leaves behind otherwise (a grandchild, a child made another way) the launcher ends: ``python -m
stem_megatron.torchrun`` makes itself the subreaper of its training processes (``PR_SET_CHILD_SUBREAPER``: an orphan
below it becomes its child, not init's) and kills its remaining children when the job ends (``end_children``).
torchrun alone kills the process group of a rank still alive at the end, not that of one that died.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
_armed_by: Optional[tuple[int, int]] = None  # (pid, thread) whose forked children die with it: dies_with_this_process


def _prctl(option: int, value: int) -> None:
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def die_with_parent(parent: Optional[int] = None) -> None:
    """This process gets SIGKILL when the thread that made it ends (its rank); exits at once if ``parent`` already
    did (it died between the fork and here)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def _after_fork_in_child() -> None:
    global _armed_by
    armed, _armed_by = _armed_by, None
    if armed is not None and armed[1] == threading.get_ident():  # the forking thread is the child's only one
        die_with_parent(armed[0])


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def dies_with_this_process() -> Iterator[None]:
    """The processes this thread forks in the block die with it (a spawned child: ``die_with_parent`` in its own
    start)."""
    global _armed_by
    _armed_by = (os.getpid(), threading.get_ident())
    try:
        yield
    finally:
        _armed_by = None


def become_subreaper() -> None:
    """Orphaned descendants of this process become its children (Linux 3.4+), for ``end_children``."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def children(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes (``/proc``)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def end_children(timeout_s: float = 10.0) -> None:
    """SIGKILL and reap every child of this process, again for those that killing one orphaned to it (a subreaper's);
    within ``timeout_s`` (a process in uninterruptible sleep does not die)."""
    deadline = time.monotonic() + timeout_s
    while (left := children(os.getpid())) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
        for pid in left:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
