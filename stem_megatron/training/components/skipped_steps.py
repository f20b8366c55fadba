"""Steps not applied (``training/step.py``: such a step changes no weight, optimizer state or table row, and the LR
schedule advances): those ``train.skip_steps`` names, whose batches are read and not trained on, and those whose loss or
gradients are not finite. The record's ``skipped_steps`` counts both since the job began, with a line for each (rank 0);
``train.max_skipped_steps`` steps in a row that were not finite stop the run with one line (``NotFiniteError``) naming
the step, the newest sealed checkpoint before it and the ways out."""

from __future__ import annotations

import torch.distributed as dist

from stem_megatron.checkpoint.atomic import newest_before, step_of
from stem_megatron.checkpoint.manager import root_dir
from stem_megatron.config import RunConfig, skip_range


class NotFiniteError(RuntimeError):
    """Too many steps in a row were not finite; the message says where to go on from (``stem-train``: one line)."""


class SkippedSteps:
    def __init__(self, cfg: RunConfig):
        self.ranges = [skip_range(entry) for entry in cfg.train.skip_steps]
        self.limit = cfg.train.max_skipped_steps
        self.root = root_dir(cfg)
        self.rank0 = dist.get_rank() == 0
        self.skipped = 0  # steps this job did not apply
        self.in_row, self.since = 0, 0  # steps not finite since the last one applied, the first of them

    def told(self, step: int) -> bool:
        """Whether ``train.skip_steps`` names ``step``."""
        return any(first <= step <= last for first, last in self.ranges)

    def count(self, record: dict) -> dict:
        """The record's ``skipped_steps``, its step counted. A step ``train.skip_steps`` names neither adds to the
        steps not finite in a row nor ends them."""
        step = record["step"]
        if not record["update_skipped"]:
            self.in_row = 0
        elif not self.told(step):
            self.since = self.since if self.in_row else step
            self.in_row += 1
        self.skipped += record["update_skipped"]
        return {"skipped_steps": self.skipped}

    def check(self, record: dict) -> None:
        """After the step's record is kept: a line for a step skipped (rank 0), and ``NotFiniteError`` where it makes
        ``train.max_skipped_steps`` steps in a row not finite (0: the first such step)."""
        step = record["step"]
        if record["update_skipped"] and self.rank0:
            why = "train.skip_steps" if self.told(step) else f"not finite, {self.in_row} in a row"
            print(f"step {step} skipped ({why}): nothing updated, {self.skipped} skipped so far", flush=True)
        if not self.in_row or self.in_row < self.limit:
            return
        said = (f"step {step}: {_span(self.since, step, 'step ', 'steps ')} had a loss or gradients that are not "
                f"finite ({self.in_row} in a row, train.max_skipped_steps={self.limit}), each skipped; ")
        last = newest_before(self.root, step)
        if last is None:
            raise NotFiniteError(said + f"no checkpoint was saved before it: start again with a lower train.lr, or "
                                        f"past these batches with train.skip_steps=[{_span(self.since, step)}]")
        raise NotFiniteError(said + f"the last good checkpoint is {last}: resume from it with a lower train.lr "
                                    f"(checkpoint.load={last} train.lr=...), or past these batches (checkpoint.load="
                                    f"{last} train.skip_steps=[{_span(max(self.since, step_of(last) + 1), step)}])")


def _span(first: int, last: int, one: str = "", several: str = "") -> str:
    """``first``-``last`` as ``train.skip_steps`` writes it (one step: ``first``), after ``one`` or ``several``."""
    return f"{one}{first}" if first == last else f"{several}{first}-{last}"
