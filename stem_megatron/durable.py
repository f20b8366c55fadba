"""Writes that survive a crash: file contents and directory entries fsynced before anyone relies on them
(checkpoints and exports become visible by a rename, which is only durable once both are on disk)."""

from __future__ import annotations

import os
from pathlib import Path


def write_synced(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` and fsync the file."""
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())


def fsync_file(path) -> None:
    """Make the contents of the written file ``path`` durable (a dataset's, before its rename)."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
