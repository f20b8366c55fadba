"""``python -m stem_megatron.torchrun``: torchrun (``torch.distributed.run``, same arguments) as the job scripts
launch it, so that a stop signal reaches the training processes and ends in one line.

torchrun's agent forwards the signals it handles to the training processes and waits for them before it kills
them. Here it handles SIGUSR1 too (the job scripts' "time limit near") and waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``
(default here 120 s, above ``train.stop_deadline_s``) while they finish the step and save
(training/preemption.py). Plain torchrun then ends with the signal's traceback; this says it in one line and exits
with 128 + the signal. The handled signals are torchrun's ``--signals-to-handle`` (``PET_SIGNALS_TO_HANDLE``;
pytorch/pytorch#160690, 2025: an older torchrun's agent dies on SIGUSR1), the environment wins over the defaults.

A rank that fails ends the job with its one line (``stem_megatron.train.report`` also leaves it in torchrun's error
file), not plain torchrun's ~35-line ChildFailedError after it, and the exit code is the rank's (128 + the signal that
ended it). When the job ends, no process it started remains (``child_processes.end_children``).
"""

from __future__ import annotations

import os
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from stem_megatron.child_processes import become_subreaper, end_children

SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"  # torchrun's defaults and SIGUSR1
SHUTDOWN_TIMEOUT_S = "120"


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", SIGNALS)
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT_S)
    args = get_args_parser().parse_args(argv)
    become_subreaper()
    line, code = None, 0
    try:
        run(args)
    except SignalException as e:
        line, code = f"torchrun: {e.sigval.name} passed on to the training processes, which have ended", 128 + e.sigval
    except ChildFailedError as e:
        line, code = failure_line(e)
    finally:
        end_children()
    if line:
        print(line, file=sys.stderr, flush=True)
        sys.exit(code)


def failure_line(error: ChildFailedError) -> tuple[str, int]:
    """The line and exit code that end the job: the first failing rank's own line (its error file's message), else
    the first signal that ended a rank (the others' errors follow from it), else the first rank's exit code."""
    def said(failure) -> str | None:
        message = failure.error_file_data.get("message")
        return message if os.path.isfile(failure.error_file) and isinstance(message, str) else None

    spoke = [(rank, failure) for rank, failure in error.failures.items() if said(failure)]
    if spoke:  # one that exited with its line, before one torchrun stopped after it had written its line
        rank, failure = min(spoke, key=lambda item: (item[1].exitcode <= 0, item[1].timestamp))
        return said(failure), failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    rank, failure = min(error.failures.items(), key=lambda item: (item[1].exitcode > 0, item[1].timestamp))
    if failure.exitcode < 0:
        return f"torchrun: rank {rank} (pid {failure.pid}) ended on {failure.signal_name()}", 128 - failure.exitcode
    return f"torchrun: rank {rank} (pid {failure.pid}) exited with code {failure.exitcode}: see its output above", \
        failure.exitcode


if __name__ == "__main__":
    main()
