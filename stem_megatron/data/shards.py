"""Preprocessing split into parts and shards, the same for any number of workers or nodes.

``--shard I/N`` takes the I-th of N consecutive runs of the sorted input files, of about equal bytes; consecutive
runs keep the global document order, so shard outputs joined in shard order (``--merge``) equal one process's. A
shard's files are grouped into parts: consecutive files of about ``part_bytes`` of input (a bigger file is a part
alone). A part is the unit of resumption: its tokens are written atomically, so a rerun skips it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PART_MB = 256  # input megabytes a part: minutes of one core's work lost at most by a kill, few files per dataset


@dataclass(frozen=True)
class Part:
    """Input files ``files`` (with ``sizes`` in bytes), the ``index``-th part of the whole input."""

    index: int
    files: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def bytes(self) -> int:
        return sum(self.sizes)


def plan_parts(files: list[Path], part_bytes: int) -> list[Part]:
    """Consecutive ``files`` grouped into parts of at least ``part_bytes`` (the last may be smaller)."""
    parts, group, sizes = [], [], []
    for path in files:
        group.append(str(path))
        sizes.append(path.stat().st_size)
        if sum(sizes) >= part_bytes:
            parts.append(Part(len(parts), tuple(group), tuple(sizes)))
            group, sizes = [], []
    if group:
        parts.append(Part(len(parts), tuple(group), tuple(sizes)))
    return parts


def shard_range(sizes: list[int], shard: int, shards: int) -> range:
    """The input files (of ``sizes`` bytes, in order) of shard ``shard`` of ``shards``: those whose middle byte falls
    in its ``1/shards`` of the input, a consecutive run."""
    if len(sizes) < shards:
        raise ValueError(f"--shard {shard}/{shards}: the input has {len(sizes)} files, fewer than {shards} shards; "
                         f"use at most {len(sizes)} shards")
    weights = [max(size, 1) for size in sizes]  # an empty file still counts
    total, before, mine = sum(weights), 0, []
    for i, weight in enumerate(weights):
        if min(int((before + weight / 2) * shards / total), shards - 1) == shard:
            mine.append(i)
        before += weight
    if not mine:
        raise ValueError(f"--shard {shard}/{shards}: the input's {len(sizes)} files are too uneven in size to give "
                         f"every shard one; use fewer shards")
    return range(mine[0], mine[-1] + 1)


def parse_shard(text: str | None) -> tuple[int, int]:
    """``--shard I/N`` as ``(I, N)``; without it, the SLURM array task's place in its array, else ``(0, 1)``."""
    if text is None:
        if "SLURM_ARRAY_TASK_ID" not in os.environ or "SLURM_ARRAY_TASK_COUNT" not in os.environ:
            return 0, 1
        task = int(os.environ["SLURM_ARRAY_TASK_ID"]) - int(os.environ.get("SLURM_ARRAY_TASK_MIN", 0))
        return task, int(os.environ["SLURM_ARRAY_TASK_COUNT"])
    try:
        shard, shards = map(int, text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r} is not I/N (e.g. 3/64: the fourth of 64 shards)") from None
    if not 0 <= shard < shards:
        raise ValueError(f"--shard {text}: I must be in 0..N-1")
    return shard, shards


def shard_prefix(prefix: Path, shard: int, shards: int) -> Path:
    """Where shard ``shard`` of ``shards`` writes: ``PREFIX-00003-of-00064`` (the whole input: ``PREFIX``)."""
    return prefix if shards == 1 else prefix.with_name(f"{prefix.name}-{shard:05d}-of-{shards:05d}")


def default_workers() -> int:
    """The CPUs this process may use: its affinity (what SLURM's cgroup gives a task), at most
    ``SLURM_CPUS_PER_TASK`` where set."""
    cpus = len(os.sched_getaffinity(0))
    slurm = os.environ.get("SLURM_CPUS_PER_TASK")
    return min(cpus, int(slurm)) if slurm and slurm.isdigit() else cpus
