"""Every collective of one training step, per rank: thread, group, op and order (``logging.collective_audit=N``).

NCCL needs every rank to issue the collectives of the communicators it shares with another rank in one order:
where two ranks interleave two groups' collectives differently, each waits inside one kernel for a peer that waits
inside the other (with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` the streams share one queue), and the job hangs now and
then. gloo does not hang, so a CPU run shows the same fault only in the order itself. The audit records each call
where every backend and every thread meets it, a method of ``ProcessGroup``, for the whole of step N on every rank
(the class's methods are wrapped for that step and restored after it; nothing else is changed). After the step
the records meet on rank 0, which writes ``<out_dir>/collective_audit_step<N>.json`` and prints one line: the
collectives by thread, and where two ranks' orders on the groups they share part (``first_divergence``).

A group only one side thread issues on (the prefetch thread's planning groups) cannot interleave with another
thread's collectives, so its calls are compared apart, and only as far as both ranks recorded them: a side thread's
calls begin and end at times of their own, not the step's. Backward's calls on a GPU's autograd device thread (the
exchange's groups, megatron's bucketed reduce-scatters) are the step's own, issued in graph order while the training
thread waits, so they stay in the training thread's lane (``audit_threads``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
from pathlib import Path
from typing import Iterator, Optional

import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

from stem_megatron.training.audit_threads import in_step_order, thread_name

# ProcessGroup's collective methods, which every torch.distributed call of a step ends in (names of torch 2.6 to
# 2.13; those a release lacks are skipped)
COLLECTIVES = ("allreduce", "allreduce_coalesced", "reduce", "allgather", "all_gather_single", "_allgather_base",
               "allgather_coalesced", "all_gather_single_coalesced", "allgather_into_tensor_coalesced", "gather",
               "scatter", "reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base",
               "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "all_to_all_single",
               "alltoall_base", "alltoall", "broadcast", "barrier", "monitored_barrier")
POINT_TO_POINT = ("send", "recv")  # their order matters as a pair's: recorded on the pair (me, peer)


class _Recorder:
    """The calls of this process, in the order its threads issue them."""

    def __init__(self):
        self.calls: list[dict] = []
        self._lock = threading.Lock()

    def wrap(self, op: str, method):
        recorder = self

        def recorded(group, *args, **kwargs):
            ranks = dist.get_process_group_ranks(group)
            if op in POINT_TO_POINT:  # (tensors, peer's group rank, tag)
                me, peer = dist.get_rank(), ranks[args[1]]
                where, ranks = f"p2p {min(me, peer)}-{max(me, peer)}", sorted((me, peer))
            else:
                where = group.group_name
            with recorder._lock:
                recorder.calls.append({"order": len(recorder.calls), "thread": thread_name(),
                                       "op": op, "group": where, "ranks": list(ranks)})
            return method(group, *args, **kwargs)

        return recorded


@contextlib.contextmanager
def audited(enabled: bool, out_dir: str, step: int) -> Iterator[None]:
    """Record the body's collectives on every rank when ``enabled`` (the audited step), then write and report
    them on rank 0 (a collective over the world, after the step)."""
    if not enabled:
        yield
        return
    recorder = _Recorder()
    originals = {op: ProcessGroup.__dict__[op] for op in COLLECTIVES + POINT_TO_POINT if op in ProcessGroup.__dict__}
    for op, method in originals.items():
        setattr(ProcessGroup, op, recorder.wrap(op, getattr(ProcessGroup, op)))
    try:
        yield
    finally:
        for op, method in originals.items():
            setattr(ProcessGroup, op, method)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, recorder.calls)
    if dist.get_rank() == 0:
        report = summarize(step, dict(enumerate(gathered)))
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / f"collective_audit_step{step}.json").write_text(json.dumps(report, indent=1) + "\n")
        print(report["summary"], flush=True)


def summarize(step: int, calls: dict[int, list[dict]]) -> dict:
    """The audit's record: every rank's calls, counts by thread, the first divergence and a one-line summary."""
    threads: dict[str, int] = {}
    for call in itertools.chain.from_iterable(calls.values()):
        threads[call["thread"]] = threads.get(call["thread"], 0) + 1
    divergence = first_divergence(calls)
    by_thread = ", ".join(f"{n} from {thread}" for thread, n in sorted(threads.items(), key=lambda kv: -kv[1]))
    verdict = divergence or "every rank issues the same order on every group it shares with another"
    summary = (f"collective audit, step {step}: {sum(threads.values())} collectives on {len(calls)} ranks "
               f"({by_thread}); {verdict}")
    return {"step": step, "summary": summary, "divergence": divergence, "threads": threads,
            "calls": {str(rank): rank_calls for rank, rank_calls in calls.items()}}


def _kind(call: dict) -> tuple[str, str]:
    return call["group"], "send/recv" if call["op"] in POINT_TO_POINT else call["op"]


def first_divergence(calls: dict[int, list[dict]]) -> Optional[str]:
    """Where two ranks' collectives on the groups they share (pairs, for send/recv) first differ, in words;
    None when every pair of ranks issues them in one order. The calls of a side thread's own groups are compared
    group by group, as far as both ranks recorded them."""
    lanes = {rank: _lanes(rank_calls) for rank, rank_calls in calls.items()}
    for a, b in itertools.combinations(sorted(calls), 2):
        for lane in sorted(set(lanes[a]) | set(lanes[b])):
            mine = [c for c in lanes[a].get(lane, []) if b in c["ranks"]]
            theirs = [c for c in lanes[b].get(lane, []) if a in c["ranks"]]
            if lane:
                mine, theirs = mine[:len(theirs)], theirs[:len(mine)]
            for i, (x, y) in enumerate(itertools.zip_longest(mine, theirs)):
                if x is None or y is None or _kind(x) != _kind(y):
                    where = f"on group {lane} of a side thread" if lane else "on shared groups"
                    return (f"ranks {a} and {b} part at their collective {i + 1} {where}: {_said(a, x)}, "
                            f"{_said(b, y)}")
    return None


def _lanes(calls: list[dict]) -> dict[str, list[dict]]:
    """One rank's calls by lane: each group only one side thread (neither the training thread nor backward's) issues
    on has its own (named by the group), every other call is in lane ""."""
    threads: dict[str, set] = {}
    for call in calls:
        threads.setdefault(call["group"], set()).add(call["thread"])
    lanes: dict[str, list[dict]] = {}
    for call in calls:
        own = threads[call["group"]] == {call["thread"]} and not in_step_order(call["thread"])
        lanes.setdefault(call["group"] if own else "", []).append(call)
    return lanes


def _said(rank: int, call: Optional[dict]) -> str:
    if call is None:
        return f"rank {rank} issues nothing more"
    return f"rank {rank} issues {call['op']} on group {call['group']} from {call['thread']}"
