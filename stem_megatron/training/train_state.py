"""Where a run stands: the one object the loop moves on and its components read.

Of it a checkpoint keeps the step (``checkpoint/train_state.py``, beside the LR schedule, the spike statistics and the
random generators); the rest is this job's: where it began, where it ends, when it last saved, whether a signal
stopped it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

from stem_megatron.config import TrainConfig


@dataclass
class TrainState:
    resumed: int  # the step this job continues after (0: the run's start)
    last: int  # the last step this job trains: train.steps, or sooner with train.exit_after_steps
    step: int  # the step in training, or the last one trained
    saved_at: float = field(default_factory=time.monotonic)  # the last checkpoint's time, or the loop's start
    stopped: Optional[int] = None  # the step a signal stopped this job after

    @classmethod
    def resuming(cls, train: TrainConfig, resumed: int) -> "TrainState":
        """This job's state after step ``resumed``, its clock for saves by time starting now."""
        last = train.steps if train.exit_after_steps is None else min(train.steps, resumed + train.exit_after_steps)
        return cls(resumed, last, step=resumed)

    def steps(self) -> Iterator[int]:
        """The steps this job trains, each ``step`` while it is trained."""
        for self.step in range(self.resumed + 1, self.last + 1):
            yield self.step
