"""The step audits' logic on plain records: where two ranks' collective orders part (``collective_audit``), and the
call site a synchronising call is charged to (``sync_audit``). The collective audit of real runs:
tests/test_multinode.py; the sync audit on a GPU: tests/test_gpu.py."""

import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from stem_megatron.training.collective_audit import first_divergence, summarize
from stem_megatron.training.sync_audit import call_site, thread_and_site

ROOT = Path(__file__).resolve().parents[1]


def _call(op, group, ranks, thread="MainThread"):
    return {"op": op, "group": group, "ranks": ranks, "thread": thread}


def test_ranks_that_interleave_shared_groups_differently_part_where_they_first_differ():
    dp, tp = ("dp", [0, 1]), ("tp", [0, 1])
    same = {0: [_call("allreduce", *tp), _call("reduce_scatter", *dp)],
            1: [_call("allreduce", *tp), _call("reduce_scatter", *dp)]}
    assert first_divergence(same) is None
    swapped = {0: [_call("allreduce", *tp), _call("all_to_all_single", *dp, thread="stem-exchange_0"),
                   _call("reduce_scatter", *dp)],
               1: [_call("allreduce", *tp), _call("reduce_scatter", *dp), _call("all_to_all_single", *dp)]}
    said = first_divergence(swapped)
    assert said == ("ranks 0 and 1 part at their collective 2 on shared groups: rank 0 issues all_to_all_single "
                    "on group dp from stem-exchange_0, rank 1 issues reduce_scatter on group dp from MainThread")
    short = {0: same[0], 1: same[1][:1]}
    assert first_divergence(short).endswith("rank 1 issues nothing more")
    report = summarize(3, swapped)
    assert report["threads"] == {"MainThread": 5, "stem-exchange_0": 1} and report["divergence"] == said


def test_groups_a_pair_does_not_share_may_interleave_in_any_order():
    """Rank 0 is in groups a (with 1) and b (with 2): the order between a and b is only rank 0's to choose."""
    calls = {0: [_call("allreduce", "a", [0, 1]), _call("allreduce", "b", [0, 2])],
             1: [_call("allreduce", "a", [0, 1])],
             2: [_call("allreduce", "b", [0, 2])]}
    assert first_divergence(calls) is None
    p2p = {0: [_call("send", "p2p 0-1", [0, 1]), _call("allreduce", "a", [0, 1])],
           1: [_call("recv", "p2p 0-1", [0, 1]), _call("allreduce", "a", [0, 1])]}
    assert first_divergence(p2p) is None  # a send meets the peer's recv
    p2p[1].reverse()
    assert "part at their collective 1" in first_divergence(p2p)


def test_a_side_threads_own_group_is_compared_apart_and_as_far_as_both_ranks_recorded_it():
    """The prefetch thread plans on groups of its own (``NodeLayout.local_plan``): its calls interleave with the
    training thread's differently on each rank without harm, and one rank may record more of them in the step. Their
    own order still counts, and a group both threads issue on is one lane again."""
    dp, plan = ("dp", [0, 1]), ("plan", [0, 1])
    side = {0: [_call("all_to_all_single", *plan, "stem-prefetch"), _call("reduce_scatter", *dp),
                _call("allgather", *plan, "stem-prefetch")],
            1: [_call("reduce_scatter", *dp), _call("all_to_all_single", *plan, "stem-prefetch")]}
    assert first_divergence(side) is None
    side[1].append(_call("allreduce", *plan, "stem-prefetch"))
    assert first_divergence(side) == ("ranks 0 and 1 part at their collective 2 on group plan of a side thread: "
                                      "rank 0 issues allgather on group plan from stem-prefetch, rank 1 issues "
                                      "allreduce on group plan from stem-prefetch")
    side[1][-1] = _call("allgather", *plan)  # the main thread on the side thread's group: rank 1's one lane
    assert first_divergence(side).startswith("ranks 0 and 1 part at their collective 2 on shared groups")


def test_backward_s_collectives_on_autograd_s_device_thread_are_compared_in_the_step_s_order():
    """On a GPU, backward's collectives (the exchange's node group, DP reduce-scatters) come from autograd's device
    thread, not the training thread: two ranks that issue them in different orders part, though each group is only
    that thread's."""
    dp, local = ("dp", [0, 1]), ("local", [0, 1])
    calls = {0: [_call("reduce_scatter", *dp, "autograd"), _call("all_to_all_single", *local, "autograd")],
             1: [_call("all_to_all_single", *local, "autograd"), _call("reduce_scatter", *dp, "autograd")]}
    assert first_divergence(calls) == ("ranks 0 and 1 part at their collective 1 on shared groups: rank 0 issues "
                                       "reduce_scatter on group dp from autograd, rank 1 issues all_to_all_single on "
                                       "group local from autograd")


def test_a_synchronising_call_is_charged_to_our_innermost_frame_and_the_torch_function_under_it():
    frame = traceback.FrameSummary
    stack = traceback.StackSummary.from_list([
        frame("/x/site-packages/megatron/core/pipeline_parallel/schedules.py", 10, "f"),
        frame("/work/main/stem_megatron/host_tables/exchange.py", 147, "g"),
        frame("/x/site-packages/torch/_tensor.py", 99, "tolist")])
    assert call_site(stack) == "stem_megatron/host_tables/exchange.py:147 (torch/_tensor.py:99)"
    assert call_site(traceback.StackSummary.from_list(list(stack)[:2])) == "stem_megatron/host_tables/exchange.py:147"
    assert call_site(traceback.StackSummary.from_list(list(stack)[2:])) == "torch/_tensor.py:99"


def test_a_synchronising_call_replayed_by_the_autograd_engine_is_backward_s():
    """torch buffers a C++ warning of backward's device thread and shows it on the training thread when backward
    returns, from the frame that called the engine: charged to ``autograd``, at the call that started backward."""
    frame = traceback.FrameSummary
    stack = traceback.StackSummary.from_list([
        frame("/x/site-packages/megatron/core/pipeline_parallel/schedules.py", 10, "backward_step"),
        frame("/x/site-packages/torch/autograd/__init__.py", 364, "backward"),
        frame("/x/site-packages/torch/autograd/graph.py", 979, "_engine_run_backward")])
    assert thread_and_site(stack) == ("autograd", "megatron/core/pipeline_parallel/schedules.py:10 "
                                                  "(torch/autograd/graph.py:979), replayed from backward")
    assert thread_and_site(traceback.StackSummary.from_list(list(stack)[:2]))[0] == "MainThread"


def _sync_audit_of_two_threads(out_dir):
    """``sync_audit.audited`` with torch's CUDA calls stood in for (no GPU here) and the sync debug mode's warning
    raised by hand: 3 times on this thread, twice on a thread of its own, once on a thread started outside Python's
    threading (as torch starts autograd's device threads), once a warning of another kind."""
    import _thread
    import threading
    import warnings

    import torch

    from stem_megatron.training import sync_audit

    modes = []
    torch.cuda.synchronize = lambda: None
    torch.cuda.set_sync_debug_mode = modes.append
    shown = []
    warnings.showwarning = lambda message, *args, **kwargs: shown.append(str(message))

    def synchronise(times):
        for _ in range(times):
            warnings.warn("called a synchronizing CUDA operation", UserWarning)

    with sync_audit.audited(True, str(out_dir), 3):
        synchronise(3)
        side = threading.Thread(target=synchronise, args=(2,), name="stem-prefetch")
        side.start()
        side.join()
        done = threading.Event()
        _thread.start_new_thread(lambda: (synchronise(1), done.set()), ())
        done.wait()
        warnings.warn("something else", UserWarning)
    synchronise(1)  # after the step: not counted, shown as before
    return modes, shown, (out_dir / "sync_audit_step3_rank0.txt").read_text()


def test_the_sync_audit_counts_each_thread_s_synchronising_calls_of_the_step_only(tmp_path):
    import distributed

    modes, shown, report = distributed.run(_sync_audit_of_two_threads, 1, tmp_path)[0]
    assert modes == ["warn", 0]
    assert shown == ["something else", "called a synchronizing CUDA operation"]
    lines = report.splitlines()
    assert lines[0] == "step 3, rank 0: 6 synchronising CUDA calls"
    counts = {(line.split()[1], line.split()[0]) for line in lines[2:]}
    assert counts == {("MainThread", "3"), ("stem-prefetch", "2"), ("autograd", "1")}, report
    assert all("tests/test_audits.py" in line for line in lines[2:]), report


SANITIZED_THREAD = """
import sys, threading, torch
import torch.cuda._sanitizer as csan
from torch.utils._python_dispatch import TorchDispatchMode
from stem_megatron.host_tables.adam_thread import RowUpdates


class Seen(TorchDispatchMode):  # stands in for the sanitizer's dispatch mode, which needs a GPU
    ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((threading.current_thread().name, str(func)))
        return func(*args, **(kwargs or {}))


class Sanitizer:  # torch's CUDASanitizer with the mode above
    def __init__(self):
        self.dispatch, self.enabled = Seen(), False

    def enable(self):
        self.dispatch.__enter__()
        self.enabled = True


csan.cuda_sanitizer = Sanitizer()
if sys.argv[1] == "on":
    csan.enable_cuda_sanitizer()  # what TORCH_CUDA_SANITIZER does as torch is imported
updates = RowUpdates(True, 1, torch.device("cpu"))
updates.now(lambda: torch.ones(4).add_(1))
print(sorted({op for thread, op in Seen.ops if thread.startswith("stem-adam")}), sys.getswitchinterval())
"""


@pytest.mark.parametrize("sanitizer", ["on", "off"])
def test_a_host_thread_runs_under_the_cuda_sanitizer_where_the_process_does(sanitizer):
    """Torch's CUDA sanitizer checks only the threads in its dispatch mode, and torch enters it on the importing
    thread alone: the host threads (here CPU Adam's) enter it as they start, and stop timed thread switches, which
    could interleave two threads inside its bookkeeping. Without it they run as they always do."""
    proc = subprocess.run([sys.executable, "-c", SANITIZED_THREAD, sanitizer], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ops, interval = proc.stdout.split("] ")
    if sanitizer == "on":
        assert ops + "]" == "['aten.add_.Tensor', 'aten.ones.default']" and float(interval) == 3600.0
    else:
        assert ops + "]" == "[]" and float(interval) == 0.005
