"""The synchronising CUDA calls of one training step, per rank (``logging.sync_audit=N``): thread, call site, count.

A call that makes the host wait for the device (``.item()``, ``float()`` of a device tensor, ``.cpu()``, ``nonzero``,
a copy from pageable memory) stops the thread that issues it until the device's queue drains; on the training thread
that queue then runs dry while the host prepares the next work. torch's sync debug mode warns at each such call;
for the whole of step N every rank records each warning with its thread and call site (the innermost frame of this
project or megatron-core, and the torch function under it) and writes ``<out_dir>/sync_audit_step<N>_rank<r>.txt``,
one line per (thread, call site), the most frequent first. Rank 0 prints its total in one line.

Backward's calls are the ``autograd`` thread's (``audit_threads``): those its Python hooks make on a device thread,
and the C++ ones, which torch buffers there and replays on the training thread when backward returns, from the
frame that called the engine; they are charged to the call site that started backward, marked as replayed.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import traceback
import warnings
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from stem_megatron.training.audit_threads import AUTOGRAD, thread_name

MESSAGE = "called a synchronizing CUDA operation"  # torch's sync debug mode's warning
OURS = ("stem_megatron", "megatron/core")
ENGINE = ("torch/autograd/graph.py", "_engine_run_backward")  # where backward's C++ warnings are replayed


def call_site(stack: traceback.StackSummary) -> str:
    """``file:line`` of the innermost frame of ours or megatron's, with the innermost frame below it when that
    is elsewhere (the torch function that synchronised)."""
    ours = [f for f in stack if any(part in f.filename for part in OURS)]
    if not ours:
        return _short(stack[-1])
    site = _short(ours[-1])
    return site if ours[-1] is stack[-1] else f"{site} ({_short(stack[-1])})"


def thread_and_site(stack: traceback.StackSummary) -> tuple[str, str]:
    """(the thread a synchronising call is charged to, its call site): a warning replayed by the autograd engine is
    ``AUTOGRAD``'s, whichever thread shows it."""
    engine = stack[-1].filename.endswith(ENGINE[0]) and stack[-1].name == ENGINE[1]
    site = call_site(stack)
    return (AUTOGRAD, f"{site}, replayed from backward") if engine else (thread_name(), site)


def _short(frame: traceback.FrameSummary) -> str:
    name = frame.filename.split("site-packages/")[-1]
    for part in OURS:
        if part in name:
            name = name[name.index(part):]
    return f"{name}:{frame.lineno}"


@contextlib.contextmanager
def audited(enabled: bool, out_dir: str, step: int) -> Iterator[None]:
    """Count the body's synchronising CUDA calls by thread and call site when ``enabled`` (the audited step)."""
    if not enabled:
        yield
        return
    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if MESSAGE not in str(message):
            return shown(message, category, filename, lineno, file, line)
        stack = [f for f in traceback.extract_stack()[:-1] if f.filename != warnings.__file__]  # the warn machinery
        thread, where = thread_and_site(traceback.StackSummary.from_list(stack))
        with lock:
            counts[thread, where] += 1

    torch.cuda.synchronize()  # the last step's work is not this step's
    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=f".*{MESSAGE}")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
    rank = dist.get_rank()
    lines = [f"{n:6d}  {thread:<20} {where}" for (thread, where), n in counts.most_common()]
    total = sum(counts.values())
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"sync_audit_step{step}_rank{rank}.txt").write_text(
        f"step {step}, rank {rank}: {total} synchronising CUDA calls\n{'count':>6}  {'thread':<20} call site\n"
        + "\n".join(lines) + "\n")
    if rank == 0:
        threads = collections.Counter()
        for (thread, _), n in counts.items():
            threads[thread] += n
        by_thread = ", ".join(f"{n} on {thread}" for thread, n in threads.most_common()) or "none"
        print(f"sync audit, step {step}: {total} synchronising CUDA calls on rank 0 ({by_thread}); "
              f"{out_dir}/sync_audit_step{step}_rank0.txt", flush=True)
