"""The profiler and the two step audits, each around the one step it is set to watch (``logging.profile_step``,
``logging.collective_audit``, ``logging.sync_audit``); every other step runs as it is."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist

from stem_megatron.config import RunConfig
from stem_megatron.training import collective_audit, sync_audit
from stem_megatron.training.profiling import profiled


class Probes:
    def __init__(self, cfg: RunConfig):
        self.logging, self.out_dir = cfg.logging, cfg.out_dir
        self.rank0 = dist.get_rank() == 0

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[None]:
        """The step under the probes set to it: torch.profiler on rank 0, the collective audit (a collective over
        the world after the step) and the sync audit on every rank."""
        lg, out_dir = self.logging, self.out_dir
        with profiled(self.rank0 and step == lg.profile_step, out_dir, step), \
                collective_audit.audited(step == lg.collective_audit, out_dir, step), \
                sync_audit.audited(step == lg.sync_audit, out_dir, step):
            yield
