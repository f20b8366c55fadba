"""Who shares a node's host memory, and tensors allocated once per node in /dev/shm.

A STEM table is needed by every local rank of the pipeline stage that owns its layer (each TP rank
reads its column block, DP replicas on the node read the same block). It is mapped from one tmpfs
file per node: the node's first rank that needs it creates and initialises it, the others map the
same pages, and the file name is unlinked once everyone has it mapped, so a crashed run leaks no
/dev/shm file.

The node is the launcher's: torchrun's agent (its ``GROUP_RANK``), else SLURM's node (``SLURM_NODEID``),
never a guess from rank order. Several torchrun agents on one host are separate nodes with their own
host copies (file names carry the node), which is how multi-node runs are tested on one machine.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist


SHM_DIR = "/dev/shm"
SANITIZER = "torch.cuda._sanitizer"  # imported by torch itself where TORCH_CUDA_SANITIZER is set
SERIAL_SWITCH_S = 3600.0  # no timed thread switches in a sanitized process
HOST_THREADS = 2  # a rank's threads beside training that run OpenMP work: the row prefetch and CPU Adam


@dataclass
class NodeLayout:
    """This rank's node and its place among its DP group's nodes (``ownership.RowOwnership``)."""

    node: int  # the launcher's node number
    group: dist.ProcessGroup  # every rank of the node (host-side barriers)
    local_dp_peers: list[int]  # global ranks in my DP group on my node, sorted (includes me)
    dp_node: int  # my node's index among my DP group's nodes, ordered by their lowest rank
    dp_nodes: int  # nodes my DP group spans
    local: Optional[dist.ProcessGroup]  # my DP peers on my node (None: I am alone)
    rail: Optional[dist.ProcessGroup]  # the DP peers of my index on every node, group rank = dp_node
    # the same ranks over gloo, for host tensors (a step's id routing: no device work, no wait for the device);
    # the groups themselves where the world's backend is gloo already
    local_host: Optional[dist.ProcessGroup] = None
    rail_host: Optional[dist.ProcessGroup] = None
    # gloo groups of the same ranks for the prefetch thread alone (``node_layout(planning=True)``), which plans each
    # announced step ahead of the training thread: groups no other thread issues on keep every thread's order one
    local_plan: Optional[dist.ProcessGroup] = None
    rail_plan: Optional[dist.ProcessGroup] = None

    @property
    def peer_index(self) -> int:
        return self.local_dp_peers.index(dist.get_rank())


def launcher_node() -> int:
    """This process' node as its launcher numbers it: torchrun's agent, else SLURM's node, else 0."""
    for var in ("GROUP_RANK", "SLURM_NODEID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def ranks_sharing_cores() -> int:
    """The ranks whose threads share this process' cores: the node's ranks as their launcher counts them (torchrun's
    ``LOCAL_WORLD_SIZE``; else the SLURM step's tasks a node, as ``srun`` starting one rank a GPU sets no
    ``LOCAL_WORLD_SIZE``; else 1). Under SLURM no more than these cores hold tasks of ``SLURM_CPUS_PER_TASK``: a task
    ``srun`` bound to cores of its own shares them with nobody."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit():
        return max(1, int(local))
    counts = re.findall(r"(\d+)(?:\(x\d+\))?", os.environ.get("SLURM_STEP_TASKS_PER_NODE", ""))  # "8", "8(x2),4"
    if not counts:
        return 1
    tasks = max(int(n) for n in counts)  # every node runs as many (``node_layout``)
    per_task = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if per_task.isdigit() and int(per_task) > 0:
        tasks = min(tasks, len(os.sched_getaffinity(0)) // int(per_task))
    return max(1, tasks)


def host_threads(device: torch.device) -> int:
    """OpenMP threads of each of this rank's ``HOST_THREADS`` host threads (the row prefetch, CPU Adam), set by each
    thread for itself: a new thread otherwise runs with OpenMP's default, one thread under torchrun. The rank's budget
    is the cores this process may use (``sched_getaffinity``) over the ranks sharing them (``ranks_sharing_cores``),
    and its host threads split it: budget // 2 each, at least 1, so the node's ranks x (prefetch + Adam) threads are
    no more than its cores (16 cores, 8 ranks: a budget of 2, 1 thread each). On GPU the training thread mostly waits
    on the device; on CPU it computes with the launcher's count (cores / ranks), which a host thread does not exceed
    either. Call it on the training thread."""
    threads = max(1, len(os.sched_getaffinity(0)) // ranks_sharing_cores() // HOST_THREADS)
    return threads if device.type == "cuda" else min(threads, torch.get_num_threads())


def enter_host_thread(threads: int, device: torch.device) -> None:
    """First call of a rank's host thread (prefetch, CPU Adam): its own OpenMP team (``host_threads``), and on GPU
    the rank's device, since a new thread starts on GPU 0 and its first CUDA call (an event's wait) would open a
    context there, on every rank of the node. Where torch's CUDA sanitizer runs, the thread runs under it too."""
    enter_sanitizer()
    torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def node_layout(dp_ranks: Sequence[int], planning: bool = False) -> NodeLayout:
    """Collective over the world: every rank passes the global ranks of its DP group (and the same ``planning``).

    Besides the node groups, creates for every DP group one group per node (its peers there) and one
    "rail" per peer index (that peer on every node), with their gloo twins and (``planning``) the prefetch
    thread's gloo groups; every DP group must have as many peers on each of its nodes, and ranks numbered node by
    node (as torchrun and SLURM number them)."""
    world = dist.get_world_size()
    nodes: list = [None] * world
    dist.all_gather_object(nodes, (launcher_node(), tuple(sorted(dp_ranks))))
    dp_groups = sorted({dp for _, dp in nodes})
    nodes = [n for n, _ in nodes]
    me, node = dist.get_rank(), nodes[dist.get_rank()]
    group = None
    local = rail = (None, None, None)
    on_gloo = dist.get_backend() == "gloo"

    def new_groups(ranks: list[int]) -> tuple:
        """(the group on the world's backend, its gloo twin, the planning group), or Nones for a rank alone."""
        if len(ranks) < 2:
            return None, None, None
        device = dist.new_group(ranks)
        twin = device if on_gloo else dist.new_group(ranks, backend="gloo")
        return device, twin, dist.new_group(ranks, backend="gloo") if planning else None

    for n in sorted(set(nodes)):  # every rank creates every group, in the same order
        g = dist.new_group([r for r, m in enumerate(nodes) if m == n], backend="gloo")  # host-side sync
        if n == node:
            group = g
    for dp in dp_groups:
        by_node: dict[int, list[int]] = {}
        for r in dp:
            by_node.setdefault(nodes[r], []).append(r)
        peers = {len(ranks) for ranks in by_node.values()}
        ordered = sorted(by_node.values())
        if len(peers) != 1 or any(list(rail_ranks) != sorted(rail_ranks) for rail_ranks in zip(*ordered)):
            raise RuntimeError(f"the data-parallel group {list(dp)} spreads over nodes {by_node} unevenly or not node "
                               f"by node: launch the same number of processes on every node (torchrun "
                               f"--nproc_per_node, SLURM --ntasks-per-node)")
        for ranks in ordered:
            groups = new_groups(ranks)
            if me in ranks:
                local, mine = groups, ordered
        for rail_ranks in zip(*ordered):
            groups = new_groups(list(rail_ranks))
            if me in rail_ranks:
                rail = groups
    local_peers = next(ranks for ranks in mine if me in ranks)
    return NodeLayout(node=node, group=group, local_dp_peers=local_peers, dp_node=mine.index(local_peers),
                      dp_nodes=len(mine), local=local[0], rail=rail[0], local_host=local[1], rail_host=rail[1],
                      local_plan=local[2], rail_plan=rail[2])


class HostMemoryError(RuntimeError):
    """The node's shared memory cannot hold its STEM tables; the message names the bytes and the fixes."""


MEMINFO = "/proc/meminfo"
SELF_CGROUP = "/proc/self/cgroup"
CGROUPS = "/sys/fs/cgroup"  # where this process' cgroup files are, by the paths SELF_CGROUP names
_NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as the largest page-aligned number


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_room() -> Optional[int]:
    """Bytes this process may still take under its cgroup's memory limit (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), usage counted without reclaimable file pages as the kernel reclaims them; None
    without a limit. A container's MemAvailable is its host's, so the limit is the tighter rule there."""
    for line in (_read(SELF_CGROUP) or "").splitlines():
        _, controllers, path = line.split(":", 2)
        v2 = controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        base = CGROUPS if v2 else os.path.join(CGROUPS, "memory")
        where = os.path.join(base, path.lstrip("/"))
        if not os.path.isdir(where):  # a cgroup namespace: its root is this process' cgroup
            where = base
        limit = _read(os.path.join(where, "memory.max" if v2 else "memory.limit_in_bytes"))
        usage = _read(os.path.join(where, "memory.current" if v2 else "memory.usage_in_bytes"))
        if limit is None or usage is None or limit == "max" or int(limit) >= _NO_LIMIT:
            continue
        stat = dict(line.split() for line in (_read(os.path.join(where, "memory.stat")) or "").splitlines())
        reclaimable = int(stat.get("inactive_file" if v2 else "total_inactive_file", 0))
        return max(0, int(limit) - max(0, int(usage) - reclaimable))
    return None


def available_memory(host_memory_gib: Optional[float] = None) -> tuple[int, str]:
    """(bytes the node's tables may take, where that figure comes from). ``host_tables.host_memory_gib`` where given: a
    VM whose RAM grows as it is used (a cloud microVM) reports far less at start, in MemTotal and MemAvailable alike,
    than it can give, and only its operator knows the size. Else MemAvailable, bounded by the room under this process'
    cgroup memory limit where it has one."""
    if host_memory_gib is not None:
        return int(host_memory_gib * 2**30), "host_tables.host_memory_gib"
    with open(MEMINFO) as meminfo:
        available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    room = _cgroup_room()
    if room is not None and room < available:
        return room, "the room under this process' cgroup memory limit"
    return available, "MemAvailable"


def free_space(directory: str, host_memory_gib: Optional[float] = None) -> tuple[int, int]:
    """(free bytes in ``directory``, the memory the tables may take: ``available_memory``): a tmpfs is backed by
    memory, and its own size limit holds even where ``host_memory_gib`` is given."""
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize, available_memory(host_memory_gib)[0]


def _too_small(directory: str, need: int, free: int, available: int, host_memory_gib: Optional[float]
               ) -> HostMemoryError:
    gib = 2**30
    source = available_memory(host_memory_gib)[1]
    return HostMemoryError(
        f"the STEM host tables of this node need {need / gib:.2f} GiB in {directory} (a copy of each table, and "
        f"the Adam moments of the rows this node owns), but it has {free / gib:.2f} GiB free and the machine "
        f"{available / gib:.2f} GiB of available memory ({source}). Fixes: a larger shared-memory directory (a "
        f"container's --shm-size, or host_tables.shm_dir=<a larger tmpfs>), host_tables.host_memory_gib=<GiB the "
        f"node can give> where the machine's figure understates it (a VM whose RAM grows as it is used), bf16 table "
        f"copies (host_tables.read_dtype=bf16), more nodes (each holds the moments of 1/N of the rows), a smaller "
        f"stem.ratio or model.vocab_size, more pipeline stages (each holds only its layers' tables), or "
        f"host_tables.placement=device when the tables fit on the GPU. `stem-flops --memory <overrides> --nodes N` "
        f"plans a run's memory before launch")


def shared_tensors(
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    group: dist.ProcessGroup,
    init: Callable[[str, torch.Tensor], None],
    directory: str = SHM_DIR,
    host_memory_gib: Optional[float] = None,
) -> dict[str, torch.Tensor]:
    """Map one node-shared tensor per name, of ``specs[name] = (shape, dtype)`` (collective over the node
    ``group``).

    Every rank of the group calls this with the names it needs; the lowest rank needing a name
    creates the file and runs ``init(name, tensor)`` before anyone else reads it. The node's bytes are
    checked against the directory's free space and the memory the tables may take (``available_memory``) first,
    and claimed up front (``posix_fallocate``), so running out is a clear error at start, never a bus error later;
    every rank of the node raises it.
    """
    needed: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(needed, (specs, free_space(directory, host_memory_gib)), group=group)
    me = dist.get_rank(group)
    mine_to_create = [n for n in specs if min(i for i, (ns, _) in enumerate(needed) if n in ns) == me]

    def nbytes(spec) -> int:
        shape, dtype = spec
        return math.prod(shape) * torch.tensor([], dtype=dtype).element_size()

    need = sum(nbytes(spec) for spec in {n: spec for ns, _ in needed for n, spec in ns.items()}.values())
    free, available = needed[0][1]  # one rank's view, so that the whole node decides alike
    if need > min(free, available):
        raise _too_small(directory, need, free, available, host_memory_gib)
    failed = None
    for name in mine_to_create:
        fd = os.open(os.path.join(directory, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes(specs[name]))
        except OSError as error:  # ENOSPC: another job took the space since the check
            failed = str(error)
            break
        finally:
            os.close(fd)
    failures: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(failures, failed, group=group)
    if any(failures):
        for name in mine_to_create:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
        raise _too_small(directory, need, *free_space(directory, host_memory_gib), host_memory_gib)
    tensors = {n: torch.from_file(os.path.join(directory, n), shared=True, size=math.prod(shape), dtype=dtype)
               .view(shape) for n, (shape, dtype) in specs.items()}
    for name in mine_to_create:
        init(name, tensors[name])
    dist.barrier(group)  # initialised and mapped everywhere: the names can go
    for name in mine_to_create:
        os.unlink(os.path.join(directory, name))
    return tensors


# Torch's CUDA stream sanitizer (``TORCH_CUDA_SANITIZER=1``, docs/gpu.md) checks every kernel's tensor reads and writes
# against the events recorded and waited between streams: what the working set, the prefetch and the row transfers rely
# on. It sees only the threads in its dispatch mode, entered by the thread that imports torch, so the prefetch and Adam
# threads enter it as they start (``enter_host_thread``). Its bookkeeping is Python without a lock, so a sanitized
# process also stops switching threads on a timer: a thread gives up the interpreter only where it waits or calls into
# torch, and two threads never interleave inside the bookkeeping.
def enter_sanitizer() -> None:
    """A new thread's first call: where the process runs the sanitizer (from the environment, or
    ``enable_cuda_sanitizer``), this thread's kernels are checked too."""
    module = sys.modules.get(SANITIZER)
    if module is not None and module.cuda_sanitizer.enabled:
        sys.setswitchinterval(SERIAL_SWITCH_S)
        module.enable_cuda_sanitizer()
