"""Atomic checkpoint directories: write into a staging directory, fsync, rename, then move ``latest``.

Layout under a checkpoint root::

    latest              one line: the name of the newest complete checkpoint ("step_000020")
    step_000020/        complete checkpoints (a rename made them visible, so they are never partial)
    .tmp-step_000030/   a save in progress, or the remains of a killed one (ignored, removed on save)

Every rank writes its part into the staging directory; then the files are fsynced and checksummed
(the work split over the ranks), rank 0 writes ``manifest.json``, renames the directory and only then
replaces ``latest`` (write, fsync, rename). A run killed at any point leaves ``latest`` naming the
previous complete checkpoint. Loading re-checks every file's size and CRC32 against the manifest, so
a truncated or corrupted checkpoint is reported by name instead of loading garbage.

Retention counts the sealed checkpoints up to the one ``latest`` names: that one and the ones before it are the run's
history. Those after it belong to a branch abandoned by a rollback (``checkpoint.load`` of an earlier step): they are
left alone, and a save of the same step replaces each.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from stem_megatron.durable import fsync_dir, write_synced

MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the run."""


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def staging_path(root: Path, step: int) -> Path:
    return Path(root) / f".tmp-{step_name(step)}"


def staging_dir(root: Path, step: int) -> Path:
    """Fresh staging directory for ``step`` (collective: rank 0 clears leftovers, everyone waits)."""
    tmp = staging_path(root, step)
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    return tmp


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def _crc32(path: Path, sync: bool) -> tuple[int, int]:
    """(size, CRC32) of a file, optionally fsyncing it (a read-only descriptor suffices on Linux)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
        if sync:
            os.fsync(f.fileno())
    return size, crc


def _checksums(directory: Path, sync: bool) -> dict[str, list[int]]:
    """{file: [size, crc32]} for every file under ``directory``; ranks split the files (collective)."""
    names = _files(directory)
    mine = {n: list(_crc32(directory / n, sync)) for n in names[dist.get_rank()::dist.get_world_size()]}
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in sorted(part.items())}


def commit(staging: Path, step: int, meta: dict, keep: int, keep_every: int = 0) -> Path:
    """Seal the staging directory as ``step_<step>`` and point ``latest`` at it (collective), then ``retire``."""
    dist.barrier()  # every rank has written its files
    files = _checksums(staging, sync=True)
    root = staging.parent
    final = root / step_name(step)
    if dist.get_rank() == 0:
        for sub in sorted({p.parent for p in staging.rglob("*")} | {staging}, key=lambda p: -len(p.parts)):
            fsync_dir(sub)
        write_synced(staging / MANIFEST, json.dumps({"step": step, "files": files, **meta}, indent=1))
        if final.exists():  # re-saving a step (e.g. after a resume): keep the old one until the swap
            old = root / f".old-{final.name}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            staging.rename(final)
            shutil.rmtree(old)
        else:
            staging.rename(final)
        fsync_dir(root)
        write_synced(root / f".{LATEST}.tmp", final.name + "\n")
        os.replace(root / f".{LATEST}.tmp", root / LATEST)
        fsync_dir(root)
        retire(root, step, keep, keep_every)
    dist.barrier()
    return final


def retire(root: Path, latest: int, keep: int, keep_every: int) -> None:
    """Remove the sealed checkpoints at or before step ``latest`` (the one ``latest`` names) but the newest ``keep``
    of them (0: all kept) and those whose step is a multiple of ``keep_every`` (milestones); those after it, an
    abandoned branch, stay."""
    history = [p for p in complete_checkpoints(root) if step_of(p) <= latest]
    for old in history[:-keep] if keep > 0 else []:
        if not (keep_every and step_of(old) % keep_every == 0):
            shutil.rmtree(old)


def newest_before(root: Path, step: int) -> Optional[Path]:
    """The newest sealed checkpoint under ``root`` from before ``step`` (what a rollback past ``step`` resumes from),
    None without one."""
    before = [p for p in complete_checkpoints(root) if step_of(p) < step]
    return before[-1] if before else None


def step_of(name: str | Path) -> Optional[int]:
    """The step a checkpoint directory's name says (``step_000020``: 20), None for another name."""
    match = _STEP_DIR.match(Path(name).name)
    return int(match.group(1)) if match else None


def latest_name(root: Path) -> Optional[str]:
    """What ``<root>/latest`` names, None without one."""
    marker = Path(root) / LATEST
    return marker.read_text().strip() if marker.exists() else None


def leftovers(root: Path) -> list[str]:
    """The names under ``root`` that a run leaves there: ``latest``, ``step_*`` directories (sealed or not) and the
    staging (``.tmp-step_*``) and swap (``.old-step_*``) directories of saves, sorted."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if p.name == LATEST or _STEP_DIR.match(p.name.removeprefix(".tmp-").removeprefix(".old-")))


def complete_checkpoints(root: Path) -> list[Path]:
    """Sealed checkpoint directories under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / MANIFEST).exists()]
    return sorted(found, key=step_of)


def resolve(path: Path) -> Optional[Path]:
    """The checkpoint to load from ``path``: a step directory itself, or the one a root's ``latest``
    names. None if ``path`` holds no checkpoint yet (a fresh run)."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return path
    marker = path / LATEST
    if not marker.exists():
        if complete_checkpoints(path):
            raise CheckpointError(f"{path} has checkpoints but no '{LATEST}' marker; pass one of them "
                                  f"explicitly, e.g. checkpoint.load={complete_checkpoints(path)[-1]}")
        return None
    target = path / marker.read_text().strip()
    if not (target / MANIFEST).exists():
        raise CheckpointError(f"{marker} names {target.name}, which is missing or has no {MANIFEST}; "
                              f"pass an earlier checkpoint explicitly (checkpoint.load=<dir>)")
    return target


def verify(checkpoint: Path) -> dict:
    """The manifest, after checking every listed file's size and CRC32 (collective)."""
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
        expected = manifest["files"]
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointError(f"{checkpoint / MANIFEST} is unreadable ({error}); the checkpoint is incomplete "
                              f"or corrupt: resume from an earlier one (checkpoint.load=<dir>)") from error
    problems = []
    missing = sorted(set(expected) - set(_files(checkpoint)))
    problems += [f"{name} is missing" for name in missing]
    names = sorted(set(expected) - set(missing))
    mine = {}
    for name in names[dist.get_rank()::dist.get_world_size()]:
        size, crc = _crc32(checkpoint / name, sync=False)
        want_size, want_crc = expected[name]
        if size != want_size:
            mine[name] = f"{name} has {size} bytes, the manifest says {want_size} (truncated?)"
        elif crc != want_crc:
            mine[name] = f"{name} fails its CRC32 check (corrupted)"
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    problems += [msg for part in parts for msg in part.values()]
    if problems:
        raise CheckpointError(f"checkpoint {checkpoint} is damaged: " + "; ".join(problems[:5])
                              + ("; ..." if len(problems) > 5 else "")
                              + ". Resume from an earlier checkpoint (checkpoint.load=<dir>) or start fresh.")
    return manifest
