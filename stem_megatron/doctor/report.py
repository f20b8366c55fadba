"""One line per check, for people: ``ok`` / ``WARN`` / ``FAIL`` / ``skipped`` and why, and nothing else. ``WARN``
is a finding that costs speed, not correctness (no Transformer Engine on a GPU node): it fails nothing and blocks
no training check.

A check runs with Python warnings off (whatever a check's code warns about, e.g. TE or torch on a GPU: its line
says what matters) and with what native code prints (DeepSpeed's op build, TE's loader) sent to a scratch file; an
exception becomes a FAIL line with its first line and the fix, never a traceback.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass
from typing import Callable

OK, WARN, FAIL, SKIPPED = "ok", "WARN", "FAIL", "skipped"


@dataclass
class Result:
    status: str
    name: str
    detail: str

    def line(self) -> str:
        return f"{self.status:<8} {self.name}: {self.detail}"


class Broken(Exception):
    """What a check found wrong, and how to fix it (the message is printed as is)."""


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


@contextlib.contextmanager
def quiet():
    """Python warnings off; file descriptors 1 and 2 (where native libraries and subprocesses print) to a scratch
    file while the block runs."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as sink, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)


def run_check(name: str, check: Callable[[], tuple[str, str]], fix: str) -> Result:
    """``check()`` returns ``(status, detail)`` or raises: ``Broken`` with its own message, anything else with
    ``fix`` appended. The result's line is printed at once (long checks show progress)."""
    try:
        with quiet():
            status, detail = check()
    except Broken as e:
        status, detail = FAIL, str(e)
    except Exception as e:  # noqa: BLE001 - any error is a finding to report, not a crash
        status, detail = FAIL, f"{first_line(e)}; fix: {fix}"
    result = Result(status, name, detail)
    print(result.line(), flush=True)
    return result
