"""Torch's CUDA stream sanitizer (``TORCH_CUDA_SANITIZER=1``, docs/gpu.md) over the host tables' own threads.

The sanitizer checks every kernel's tensor reads and writes against the events recorded and waited between streams:
what the working set, the prefetch and the row transfers rely on. It sees only the threads in its dispatch mode,
and torch enters that on the thread that imports torch, so the prefetch and CPU Adam threads enter it as they start
(``node.enter_host_thread``); otherwise their side streams' copies would go unchecked. Its bookkeeping is Python
without a lock, so a sanitized process also stops switching threads on a timer: a thread gives up the interpreter
only where it waits or calls into torch, and two threads never interleave inside the bookkeeping.
"""

from __future__ import annotations

import sys

SANITIZER = "torch.cuda._sanitizer"  # imported by torch itself where TORCH_CUDA_SANITIZER is set
SERIAL_SWITCH_S = 3600.0  # no timed thread switches in a sanitized process


def enter_sanitizer() -> None:
    """A new thread's first call: where the process runs the sanitizer (from the environment, or
    ``enable_cuda_sanitizer``), this thread's kernels are checked too."""
    module = sys.modules.get(SANITIZER)
    if module is not None and module.cuda_sanitizer.enabled:
        sys.setswitchinterval(SERIAL_SWITCH_S)
        module.enable_cuda_sanitizer()
