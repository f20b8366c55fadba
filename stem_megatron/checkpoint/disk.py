"""A save that fails for lack of space or quota, or on a filesystem it may not write, named in one line: the errno,
the filesystem's mount point, its free bytes and the checkpoint's size.

The errno does not always reach the caller: megatron-core's checkpoint writer (0.19.2) reports a worker's exception
as ``RuntimeError("... error: <class 'OSError'>")`` (its result check asserts that it got a list, and only the
exception's class goes on), and torch's zip writer, which ``torch.save`` and megatron's tensor files go through,
reports a failed write as ``unexpected pos`` or ``file write failed``. An ``OSError`` anywhere in the exception's
chain (torch's ``CheckpointException`` keeps each rank's failure in ``failures``) names it; else the filesystem is
asked: mounted read-only, or less free space than the checkpoint needs (the partial save removed), tells the same.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Iterator, Optional

FULL = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE = (errno.EROFS, errno.EACCES)


def _errnos(error: BaseException) -> Iterator[int]:
    """The errnos of the ``OSError``s in ``error``'s chain."""
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            yield e.errno
        todo += [e.__cause__, e.__context__]
        for failure in getattr(e, "failures", {}).values():  # torch's CheckpointException: {rank: (exception, trace)}
            todo.append(failure[0] if isinstance(failure, tuple) else failure)


def _existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem that holds ``path`` (or would: its nearest existing ancestor's)."""
    path = _existing(path).resolve()
    while not os.path.ismount(path):
        path = path.parent
    return path


def failure(error: BaseException, root: Path, step: int, size: int, latest: Optional[str]) -> Optional[str]:
    """The line for a save of the checkpoint after ``step`` (``size`` bytes) under ``root`` that ``error`` ended for
    want of space or of write access, None for any other cause. ``latest``: the checkpoint that stays latest."""
    stat = os.statvfs(_existing(root))
    free = stat.f_bavail * stat.f_frsize
    code = next((c for c in _errnos(error) if c in FULL + NOT_WRITABLE), None)
    if code is None and stat.f_flag & os.ST_RDONLY:
        code = errno.EROFS
    elif code is None and free < size:
        code = errno.ENOSPC
    if code is None:
        return None
    fix = ("free space there (or quota)" if code in FULL else "make it writable") + \
        " or set checkpoint.dir to another filesystem"
    kept = (f"{root / 'latest'} stays {latest}; {fix}, then rerun: it resumes from {latest}" if latest else
            f"this run has no checkpoint yet; {fix}")
    return (f"checkpoint after step {step} not saved: {errno.errorcode[code]} ({os.strerror(code)}) writing {root}, "
            f"on the filesystem mounted at {mount_point(root)}: {free:,} bytes free, the checkpoint needs {size:,}. "
            f"Its partial directory is removed and {kept}")
