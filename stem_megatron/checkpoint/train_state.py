"""The rest of the training state: step, LR schedule, spike statistics and random number generators.

With this and the weights/optimizer/table state a resumed run continues exactly where the saved one
was: the data position is the step itself (``micro_batches(start_step=...)`` needs no other state).
RNG states are saved per rank (every generator megatron and torch use) and restored on the same rank;
under another DP size or node count each rank takes those of its (pipeline, tensor) position on DP rank 0,
under another TP or PP size it keeps those seeded at start.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker


def coordinates() -> dict:
    return {"pp": parallel_state.get_pipeline_model_parallel_rank(),
            "tp": parallel_state.get_tensor_model_parallel_rank(),
            "dp": parallel_state.get_data_parallel_rank()}


def _rng_path(directory: Path, c: dict) -> Path:
    return Path(directory) / "rng" / f"pp{c['pp']}-tp{c['tp']}-dp{c['dp']}.pt"


def save(directory: Path, step: int, scheduler, detector) -> None:
    """Rank 0 writes the shared state; every rank writes its RNG states."""
    c = coordinates()
    path = _rng_path(directory, c)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
                "tracker": get_cuda_rng_tracker().get_states(),
                "numpy": np.random.get_state(), "python": random.getstate()}, path)
    if dist.get_rank() == 0:
        torch.save({"step": step, "scheduler": scheduler.state_dict(), "spikes": detector.state_dict()},
                   Path(directory) / "train_state.pt")


def load(directory: Path, scheduler, detector, saved_layout: dict, layout: dict) -> int:
    """Restore schedule, spike statistics and RNG; returns the step the checkpoint was taken after.
    Under another TP or PP size no saved generators belong to a rank's position: every rank keeps those
    seeded at start (they drive dropout only, which the models here do not use)."""
    state = torch.load(Path(directory) / "train_state.pt", map_location="cpu", weights_only=False)
    scheduler.load_state_dict(state["scheduler"])  # its step; the schedule is this run's (optim.build_scheduler)
    detector.load_state_dict(state["spikes"])
    if (saved_layout["tp"], saved_layout["pp"]) != (layout["tp"], layout["pp"]):
        return int(state["step"])
    c = coordinates()
    if saved_layout != layout:
        c["dp"] = 0
    rng = torch.load(_rng_path(directory, c), map_location="cpu", weights_only=False)
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    get_cuda_rng_tracker().set_states(rng["tracker"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    return int(state["step"])
