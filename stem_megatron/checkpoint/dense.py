"""Dense weights and megatron optimizer state through megatron-core dist-checkpointing.

Each rank contributes its TP/PP/EP shard as ``ShardedTensor``s; the distributed optimizer's state uses
megatron's ``dp_reshardable`` layout (each rank saves its own buffer ranges, no gathering), which
megatron re-splits on load, so a checkpoint loads under a different DP size. The STEM tables on the host
are not parameters of the model and are saved separately (``host_tables``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.validation import StrictHandling

# How megatron lays out the state (stored with the checkpoint; loading must request the same).
# non_homogeneous_layers: STEM and dense layers have different MLPs, so layers are keyed one by one
# rather than stacked along a layer axis.
METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True, "non_homogeneous_layers": True}


def _sharded(model, optimizer, is_loading: bool) -> dict:
    stage = model.module  # the GPTModel inside megatron's DDP wrapper
    model_sd = stage.sharded_state_dict(metadata=METADATA)
    return {"model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=METADATA)}


def save(model, optimizer, directory: Path) -> None:
    """Write this rank's shards of the weights and optimizer state (collective)."""
    Path(directory).mkdir(exist_ok=True)
    dist_checkpointing.save(_sharded(model, optimizer, is_loading=False), str(directory),
                            content_metadata=METADATA)


def _empty_adam_state(optimizer) -> None:
    """Give every parameter a zero Adam state to load into. megatron's torch-Adam fallback (no TE/Apex:
    our CPU path) creates ``step`` only at the first step, and its distributed optimizer cannot
    describe (hence load) the state of an optimizer that has not stepped yet. TE's and Apex's FusedAdam
    (GPU) keep ``step`` in the param group and megatron initialises their state itself; a per-parameter
    ``step`` would break their ``state_dict()``, so they are left alone."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = part.optimizer
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param].update(step=torch.zeros(()), exp_avg=torch.zeros_like(param),
                                              exp_avg_sq=torch.zeros_like(param))


def _set_steps(optimizer, step: int) -> None:
    """Restore torch Adam's per-parameter ``step`` (bias correction) from the checkpoint's step.

    On megatron's torch-Adam fallback (no TE/Apex: our CPU path) the distributed optimizer does not
    round-trip it: after a load every parameter holds the template's value, in one shared tensor that
    torch increments once per parameter. Every optimizer step is a training step here (fp32/bf16
    never skip an update), so the training step is the right count.
    """
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in part.optimizer.state.values():
            if "step" in state:
                state["step"] = torch.tensor(float(step))


def load(model, optimizer, directory: Path, step: int) -> None:
    """Restore weights and optimizer state saved by ``save`` after ``step`` steps (collective); any key
    mismatch is an error."""
    _empty_adam_state(optimizer)
    state = dist_checkpointing.load(_sharded(model, optimizer, is_loading=True), str(directory),
                                    strict=StrictHandling.RAISE_ALL)
    model.module.load_state_dict(state["model"])
    with torch.no_grad():  # fp32 main params are views of the (grad-requiring) model params
        optimizer.load_state_dict(state["optimizer"])
    _set_steps(optimizer, step)


def load_weights(model, directory: Path) -> None:
    """Restore only the weights (initialising a new run, e.g. mid-training, from a checkpoint)."""
    stage = model.module
    state = dist_checkpointing.load({"model": stage.sharded_state_dict(metadata=METADATA)}, str(directory),
                                    strict=StrictHandling.LOG_UNEXPECTED)
    stage.load_state_dict(state["model"])
