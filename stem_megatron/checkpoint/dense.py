"""Dense weights and megatron optimizer state through megatron-core dist-checkpointing.

Each rank contributes its TP/PP/EP shard as ``ShardedTensor``s. The distributed optimizer's state uses
megatron's ``fully_reshardable`` layout: at save its DP group gathers its buffer ranges (fp32 main
params, exp_avg, exp_avg_sq) and writes them in model space, one tensor per parameter with that
parameter's TP/PP/EP sharding; on load every rank reads the parameters it holds and keeps its own DP
range. A checkpoint thus loads under another TP, PP, EP or DP size. The STEM tables on the host are
not parameters of the model and are saved separately (``host_tables``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.filesystem_async import get_write_results_queue
from megatron.core.dist_checkpointing.validation import StrictHandling

from stem_megatron.checkpoint.atomic import CheckpointError
from stem_megatron.checkpoint.bucket_offsets import unpadded_offsets
from stem_megatron.child_processes import dies_with_this_process
from stem_megatron.model.weights import current_weights

# How megatron lays out the state (stored with the checkpoint; loading must request the same).
# non_homogeneous_layers: STEM and dense layers have different MLPs, so layers are keyed one by one
# rather than stacked along a layer axis.
METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True, "non_homogeneous_layers": True}


def _sharded(model, optimizer, is_loading: bool) -> dict:
    stage = model.module  # the GPTModel inside megatron's DDP wrapper
    model_sd = stage.sharded_state_dict(metadata=METADATA)
    with contextlib.nullcontext() if is_loading else unpadded_offsets(optimizer):
        return {"model": model_sd,
                "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=METADATA)}


def results_manager_start() -> str:
    """How megatron's writer starts the manager process that returns its results, made at a rank's first save.
    Spawned (megatron's default), it imports torch to unpickle the first result: ~2 s of a 2-rank CPU run's first save
    (2.3 s, 0.4 s forked). Forked, it has torch already; but CUDA does not support a forked child of a process whose
    CUDA context is up (the child inherits the context's handles and pinned mappings), so a rank that initialised
    CUDA spawns it: once a run, beside minutes of GPU steps. Either way it dies with its rank (``child_processes``)."""
    return "spawn" if torch.cuda.is_initialized() else "fork"


def state(model, optimizer) -> dict:
    """This rank's shards of the weights and optimizer state, as ``write`` saves them (collective: the DP group
    all-gathers the optimizer state)."""
    current_weights(model)
    return _sharded(model, optimizer, is_loading=False)


def write(sharded: dict, directory: Path) -> None:
    """Write ``state``'s shards (collective)."""
    Path(directory).mkdir(exist_ok=True)
    with dies_with_this_process():
        get_write_results_queue(results_manager_start())
    dist_checkpointing.save(sharded, str(directory), content_metadata=METADATA)


def save(model, optimizer, directory: Path) -> None:
    """Write this rank's shards of the weights and optimizer state (collective)."""
    write(state(model, optimizer), directory)


def _torch_adams(optimizer):
    """The inner torch Adam/AdamW of each part of ``optimizer``: megatron's fallback without TE/Apex (our
    CPU path), which keeps a per-parameter ``step``. TE's and Apex's FusedAdam (GPU) keep ``step`` in the
    param group, megatron handles their state itself, and a per-parameter ``step`` would break their
    ``state_dict()``, so they are left alone."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(part.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            yield part.optimizer


def _empty_adam_state(optimizer) -> None:
    """Give every parameter a zero Adam state to load into: torch Adam creates its state only at the first
    step, and megatron's distributed optimizer cannot describe (hence load) the state of an optimizer
    that has not stepped yet."""
    for inner in _torch_adams(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param].update(step=torch.zeros(()), exp_avg=torch.zeros_like(param),
                                              exp_avg_sq=torch.zeros_like(param))


def _as_configured(part, saved_groups: list[dict]) -> list[dict]:
    """The hyperparameters of ``part``'s param groups, which the caller puts back over the loaded ones: a resume takes
    lr, betas, eps and weight decay from this run's config (the LR schedule too: ``optim.build_scheduler``), and the
    loaded ``step`` (FusedAdam's, in the group) stays. megatron pairs each saved group with a current one by the
    group's settings, ``max_lr`` and ``min_lr`` among them (``param_group_identifier_keys``), so a changed
    ``train.lr`` or ``min_lr_ratio`` would find no saved group (KeyError in ``load_state_dict``); every group here has
    the config's lr and min lr (no per-group lr), so ``saved_groups`` are given this run's to pair."""
    for group in saved_groups:
        group.update(max_lr=part.config.lr, min_lr=part.config.min_lr)
    return [{k: v for k, v in group.items() if k not in ("params", "step")} for group in part.optimizer.param_groups]


def _load_optimizer(optimizer, state: dict) -> None:
    """megatron's ``optimizer.load_state_dict`` in its two halves, with torch Adam's per-parameter ``step``
    set aside in between: megatron-core's ``load_parameter_state_from_fully_reshardable`` copies every
    tensor of a parameter's optimizer state from the checkpoint's entries, which skip ``step`` (it lives in
    the param groups), so on the torch-Adam fallback it fails with KeyError 'step' (0.16.1, and 0.19.2 in
    ``_set_main_param_and_optimizer_states``). ``_set_steps`` puts it back. The hyperparameters stay this run's
    (``_as_configured``)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    for part, part_state in zip(parts, [state] if len(parts) == 1 else [state[k] for k in sorted(state)]):
        param_state = part_state.pop("param_state", None)  # None: not the distributed optimizer
        inner_state = part_state.get("optimizer", part_state)  # megatron's FP32Optimizer: torch's state dict itself
        configured = _as_configured(part, inner_state["param_groups"])
        part.load_state_dict(part_state)  # param groups: step, and the saved hyperparameters
        for group, values in zip(part.optimizer.param_groups, configured):
            group.update(values)
        if param_state is not None:
            for inner in _torch_adams(part):
                for entry in inner.state.values():
                    entry.pop("step", None)
            part.load_parameter_state_from_fully_reshardable(param_state)


def _set_steps(optimizer, step: int) -> None:
    """Set torch Adam's per-parameter ``step`` (bias correction) from the checkpoint's step, one tensor per
    parameter (megatron's load leaves one tensor shared by all parameters, which torch would increment
    once per parameter). Every optimizer step is a training step here (fp32/bf16 never skip an update),
    so the training step is the right count."""
    for inner in _torch_adams(optimizer):
        for param_state in inner.state.values():
            param_state["step"] = torch.tensor(float(step))


def load(model, optimizer, directory: Path, step: int) -> None:
    """Restore weights and optimizer state saved by ``save`` after ``step`` steps, resharded to this run's
    TP/PP/EP/DP layout (collective); any key mismatch is an error."""
    saved = dist_checkpointing.load_content_metadata(str(directory)) or {}
    if saved.get("distrib_optim_sharding_type") != METADATA["distrib_optim_sharding_type"]:
        raise CheckpointError(
            f"{directory} holds the optimizer state in megatron's "
            f"{saved.get('distrib_optim_sharding_type', 'unknown')!r} format; this version reads "
            f"{METADATA['distrib_optim_sharding_type']!r} only. Resume it with the version that wrote it, or "
            f"start a new run from its weights (checkpoint.init_from)")
    _empty_adam_state(optimizer)
    state = dist_checkpointing.load(_sharded(model, optimizer, is_loading=True), str(directory),
                                    strict=StrictHandling.RAISE_ALL)
    model.module.load_state_dict(state["model"])
    with torch.no_grad():  # fp32 main params are views of the (grad-requiring) model params
        _load_optimizer(optimizer, state["optimizer"])
    _set_steps(optimizer, step)


def load_weights(model, directory: Path) -> None:
    """Restore only the weights (initialising a new run, e.g. mid-training, from a checkpoint)."""
    stage = model.module
    state = dist_checkpointing.load({"model": stage.sharded_state_dict(metadata=METADATA)}, str(directory),
                                    strict=StrictHandling.LOG_UNEXPECTED)
    stage.load_state_dict(state["model"])
