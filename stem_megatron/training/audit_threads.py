"""Which thread a step's work ran on, as both step audits name it.

On a GPU, backward runs on autograd's device threads (one per device), which torch starts in C++: Python sees them
as dummy threads (``threading._DummyThread``, named ``Dummy-N`` in order of first contact). The audits name them
``AUTOGRAD``: their work
is the training step's, issued in the graph's order while the training thread waits inside backward, so the
collective audit compares it in the training thread's lane, and the sync audit reports it apart from that thread.
"""

from __future__ import annotations

import threading

AUTOGRAD = "autograd"
TRAINING = "MainThread"


def thread_name() -> str:
    """The current thread's name for the audits: ``AUTOGRAD`` for a thread torch started in C++."""
    thread = threading.current_thread()
    return AUTOGRAD if isinstance(thread, threading._DummyThread) else thread.name


def in_step_order(thread: str) -> bool:
    """Whether ``thread``'s collectives belong to the step's one order: the training thread's and backward's."""
    return thread in (TRAINING, AUTOGRAD)
