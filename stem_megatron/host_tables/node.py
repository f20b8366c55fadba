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
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"


@dataclass
class NodeLayout:
    """This rank's node, the node's process group, and its DP peers on the same node."""

    node: int
    group: dist.ProcessGroup
    local_dp_peers: list[int]  # global ranks in my DP group on my node, sorted (includes me)

    @property
    def peer_index(self) -> int:
        return self.local_dp_peers.index(dist.get_rank())


def launcher_node() -> int:
    """This process' node as its launcher numbers it: torchrun's agent, else SLURM's node, else 0."""
    for var in ("GROUP_RANK", "SLURM_NODEID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def node_layout(dp_ranks: Sequence[int]) -> NodeLayout:
    """Collective over the world: every rank passes the global ranks of its DP group."""
    nodes: list = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, launcher_node())
    node, group = nodes[dist.get_rank()], None
    for n in sorted(set(nodes)):  # every rank creates every node group, in the same order
        g = dist.new_group([r for r, m in enumerate(nodes) if m == n], backend="gloo")  # host-side sync
        if n == node:
            group = g
    peers = sorted(r for r in dp_ranks if nodes[r] == node)
    return NodeLayout(node=node, group=group, local_dp_peers=peers)


class HostMemoryError(RuntimeError):
    """The node's shared memory cannot hold its STEM tables; the message names the bytes and the fixes."""


def _space(directory: str) -> tuple[int, int]:
    """(free bytes in ``directory``, the machine's available memory): a tmpfs is backed by memory."""
    stat = os.statvfs(directory)
    with open("/proc/meminfo") as meminfo:
        available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    return stat.f_bavail * stat.f_frsize, available


def _too_small(directory: str, need: int, free: int, available: int) -> HostMemoryError:
    gib = 2**30
    return HostMemoryError(
        f"the STEM host tables of this node need {need / gib:.2f} GiB in {directory} (each table and its two Adam "
        f"moments, fp32), but it has {free / gib:.2f} GiB free and the machine {available / gib:.2f} GiB of available "
        f"memory. Fixes: a larger shared-memory directory (a container's --shm-size, or stem.shm_dir=<a larger "
        f"tmpfs>), a smaller stem.ratio or model.vocab_size, more pipeline stages (each holds only its layers' "
        f"tables), or stem.placement=device when the tables fit on the GPU")


def shared_tensors(
    names: Sequence[str],
    shape: tuple[int, ...],
    group: dist.ProcessGroup,
    init: Callable[[str, torch.Tensor], None],
    dtype: torch.dtype = torch.float32,
    directory: str = SHM_DIR,
) -> dict[str, torch.Tensor]:
    """Map one node-shared tensor per name (collective over the node ``group``).

    Every rank of the group calls this with the names it needs; the lowest rank needing a name
    creates the file and runs ``init(name, tensor)`` before anyone else reads it. The node's bytes are
    checked against the directory's free space and the machine's available memory first, and claimed
    up front (``posix_fallocate``), so running out is a clear error at start, never a bus error later;
    every rank of the node raises it.
    """
    needed: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(needed, (sorted(names), _space(directory)), group=group)
    me = dist.get_rank(group)
    mine_to_create = [n for n in names if min(i for i, (ns, _) in enumerate(needed) if n in ns) == me]
    numel = math.prod(shape)
    nbytes = numel * torch.tensor([], dtype=dtype).element_size()
    need = len({n for ns, _ in needed for n in ns}) * nbytes
    free, available = needed[0][1]  # one rank's view, so that the whole node decides alike
    if need > min(free, available):
        raise _too_small(directory, need, free, available)
    failed = None
    for name in mine_to_create:
        fd = os.open(os.path.join(directory, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
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
        raise _too_small(directory, need, *_space(directory))
    tensors = {n: torch.from_file(os.path.join(directory, n), shared=True, size=numel, dtype=dtype).view(shape)
               for n in names}
    for name in mine_to_create:
        init(name, tensors[name])
    dist.barrier(group)  # initialised and mapped everywhere: the names can go
    for name in mine_to_create:
        os.unlink(os.path.join(directory, name))
    return tensors
