"""A run stops on SIGTERM or SIGUSR1 after one step every rank agrees on, with a checkpoint (docs/cluster.md).

SLURM sends SIGTERM before it kills a job (preemption, ``scancel``, the time limit: SIGKILL follows KillWait
seconds later); the job scripts forward SIGUSR1 two minutes before the time limit (``--signal=B:USR1@120``). The
first signal only sets a flag, so the step in flight finishes. At the end of every step each rank sends its flag
and "a checkpoint is due by time" (``checkpoint.save_interval_min``) to a MAX all-reduce over a gloo group of the
whole world, issued from the training thread at one place of the step and waited for at the end of the next one:
beside a step it costs nothing (gloo's all-reduce of a few integers takes ~2(N-1) network latencies, tens of ms at
hundreds of ranks), and every rank reads the same answer, so all stop, or save, after the same step, at most one step
after the signal. A second signal (more than ``REPEAT_S`` after the first: torchrun forwards to the training
processes the SIGTERM that SLURM sends every process of the step) or ``train.stop_deadline_s`` after the first ends
the process at once, with 128 + the signal as its status, as without a handler.

megatron's ``training/dist_signal_handler.py`` does the first part for one signal with an all-gather on the default
group (NCCL on GPU) and ``.item()`` every iteration: a device synchronisation a step, no second signal, no deadline.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
REPEAT_S = 2.0  # a signal this soon after the first is the same request, delivered twice


@dataclass(frozen=True)
class Decision:
    """What every rank learned at the end of a step: the signal some rank got (None: go on), a save due by time."""

    stop: Optional[signal.Signals] = None
    save_due: bool = False


class StopSignals:
    """Catches the stop signals while a run trains (a context manager) and turns them, and saves by time, into
    one decision a step for every rank: ``decided()`` where the step's save is decided, ``send()`` after it."""

    def __init__(self, deadline_s: float, group: Optional[dist.ProcessGroup] = None):
        self.deadline_s = deadline_s
        self.group = group
        self.received: Optional[signal.Signals] = None
        self.said = False  # rank 0 has said that it got a signal
        self._first_at = 0.0
        self._timer: Optional[threading.Timer] = None
        self._previous: dict = {}
        self._pending: Optional[tuple[torch.Tensor, object]] = None

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # Python runs handlers on the main thread only
            self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        if self._timer is not None:
            self._timer.cancel()
        if self._pending is not None and exc[0] is None:  # every rank sent it: take it, so the group is idle
            self._pending[1].wait()
        self._pending = None

    def _handle(self, signum: int, frame) -> None:
        """No print here: the handler may run inside a print of the main thread (a reentrant write raises)."""
        now = time.monotonic()
        if self.received is None:
            self.received, self._first_at = signal.Signals(signum), now
            self._timer = threading.Timer(self.deadline_s, self._exit_now, args=(signum, "train.stop_deadline_s"))
            self._timer.daemon = True
            self._timer.start()
        elif now - self._first_at > REPEAT_S:
            self._exit_now(signum, "a second signal")

    def _exit_now(self, signum: int, why: str) -> None:
        """An unbuffered write: this may run in the handler, inside a print of the main thread."""
        os.write(2, f"[rank {os.environ.get('RANK', 0)}] stopping at once ({why} after {self.received.name}): the "
                    f"last complete checkpoint is where the next run resumes\n".encode())
        os._exit(128 + signum)

    def decided(self) -> Decision:
        """The decision of the exchange sent at the end of the previous step (none before the first)."""
        if self.received is not None and not self.said:
            self.said = True
            if dist.get_rank() == 0:
                print(f"{self.received.name}: finishing the step in flight, then a checkpoint and stop (a second "
                      f"signal, or {self.deadline_s:g} s, stops at once)", flush=True)
        if self._pending is None:
            return Decision()
        flags, work = self._pending
        self._pending = None
        work.wait()
        stop, save_due = flags.tolist()
        return Decision(signal.Signals(stop) if stop else None, bool(save_due))

    def send(self, save_due: bool) -> None:
        """This rank's flags, reduced beside the next step."""
        flags = torch.tensor([int(self.received or 0), int(save_due)], dtype=torch.int64)
        self._pending = (flags, dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True))
