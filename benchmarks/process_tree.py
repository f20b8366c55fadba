"""Every process a command starts ends with it: ``tools/gpu_check.py``'s parts and
``benchmarks/gpu_step.py``'s runs.

A process group or session does not hold a run: torchrun's workers start in sessions of their own, and a child
whose parent dies is re-parented away from it. So the command becomes a child subreaper (``take_charge``: Linux's
``PR_SET_CHILD_SUBREAPER``), which makes every orphan of its descendants its own child rather than init's, and
``confined`` finds what a block started by its parent links (``descendants``), not by group: at the
block's end, normal, by an exception or by SIGTERM (``Stopped``), every such process is sent SIGTERM, given
``grace`` seconds, then SIGKILL, and reaped. Importing it needs only the standard library: gpu_check imports it
before its environment is checked.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
KILL_WAIT_S = 30  # after SIGKILL: a process that is still there is stuck in the kernel (a GPU driver's teardown)


class Stopped(SystemExit):
    """SIGTERM to a command that ``take_charge`` prepared, raised in its main thread: ``confined`` blocks on the way
    out end their processes; uncaught, the command exits with 143 (128 + SIGTERM) and no traceback."""

    def __init__(self):
        super().__init__(128 + signal.SIGTERM)


_holding = False  # inside ``confined``'s ending: SIGTERM is held until it is done
_pending = False  # a SIGTERM came while held


def _stop(signum, frame) -> None:
    global _pending
    if _holding:
        _pending = True
    else:
        raise Stopped()


def take_charge() -> None:
    """Make this process the reaper of its descendants' orphans, and SIGTERM raise ``Stopped`` (call from the main
    thread, before starting anything)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed: processes could outlive their part")
    signal.signal(signal.SIGTERM, _stop)


def descendants() -> dict[int, tuple[float, str]]:
    """Every descendant of this process, zombies included: {pid: (start time, status)}. psutil (DeepSpeed's
    dependency, so in every training environment) walks /proc's parent links; imported here, so that importing this
    module needs only the standard library (gpu_check's dry run)."""
    import psutil

    found = {}
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            found[child.pid] = (child.create_time(), child.status())
    return found


def _signal(pids, sig) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _reap(pids) -> None:
    """Collect those of ``pids`` that ended as this process's children: orphans re-parented here, and the block's
    own child (whose ``Popen`` then reads exit code 0: take its code before the block ends)."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def end_new(before: dict, grace: float) -> list[int]:
    """SIGTERM to every descendant not in ``before`` (``descendants()`` earlier), ``grace`` seconds for them to
    exit, then SIGKILL to those left and to any started meanwhile, until none is (or ``KILL_WAIT_S`` more have
    passed: a process stuck in the kernel); the pids ended."""

    def new() -> dict[int, str]:
        return {pid: state for pid, (start, state) in descendants().items() if before.get(pid, (None,))[0] != start}

    found = new()
    ended = set(found)
    _signal(found, signal.SIGTERM)
    killed_at = time.monotonic() + grace
    while True:
        _reap(found)
        found = new()
        ended |= set(found)
        live = [pid for pid, state in found.items() if state not in ("zombie", "dead")]
        if not live or time.monotonic() > killed_at + KILL_WAIT_S:
            break
        if time.monotonic() > killed_at:
            _signal(live, signal.SIGKILL)
        time.sleep(0.05)
    _reap(found)  # with none running, every zombie left is this process's child
    return sorted(ended)


@contextlib.contextmanager
def _held_back():
    """SIGTERM inside raises ``Stopped`` once it is over, not inside. (Python runs the handler in the main thread
    whichever thread the signal reached, so masking the main thread alone would not hold it.)"""
    global _holding, _pending
    _holding = True
    try:
        yield
    finally:
        _holding = False
    if _pending:
        _pending = False
        raise Stopped()


@contextlib.contextmanager
def confined(grace: float):
    """Every process started inside the block ends when it does (``end_new``); a SIGTERM meanwhile raises
    ``Stopped`` once nothing is left running."""
    before = descendants()
    try:
        yield
    finally:
        with _held_back():
            end_new(before, grace)
