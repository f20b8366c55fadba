"""``python -m stem_megatron.torchrun``: torchrun (``torch.distributed.run``, same arguments) as the job scripts
launch it, so that a stop signal reaches the training processes and ends in one line.

torchrun's agent forwards the signals it handles to the training processes and waits for them before it kills
them. Here it handles SIGUSR1 too (the job scripts' "time limit near") and waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``
(default here 120 s, above ``train.stop_deadline_s``) while they finish the step and save
(training/preemption.py). Plain torchrun then ends with the signal's traceback; this says it in one line and exits
with 128 + the signal. The handled signals are torchrun's ``--signals-to-handle`` (``PET_SIGNALS_TO_HANDLE``;
pytorch/pytorch#160690, 2025: an older torchrun's agent dies on SIGUSR1), the environment wins over the defaults.
"""

from __future__ import annotations

import os
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import get_args_parser, run

SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"  # torchrun's defaults and SIGUSR1
SHUTDOWN_TIMEOUT_S = "120"


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", SIGNALS)
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT_S)
    args = get_args_parser().parse_args(argv)
    try:
        run(args)
    except SignalException as e:
        print(f"torchrun: {e.sigval.name} passed on to the training processes, which have ended", file=sys.stderr,
              flush=True)
        sys.exit(128 + e.sigval)


if __name__ == "__main__":
    main()
