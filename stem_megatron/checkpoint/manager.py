"""Save and resume a whole run: dense state, host tables, schedule, RNG, in one atomic directory.

    step_000020/
      manifest.json      sizes + CRC32 of every file, the step, the layout and model it was saved with
      dense/             megatron dist-checkpointing: weights and megatron optimizer state
      stem/              host-resident U_l and Adam moments by (layer, d_ff columns), dist-checkpointing
      train_state.pt     step, LR schedule, spike-detector statistics
      rng/               per-rank RNG states

A resume takes the step and the state from the checkpoint and the schedule and optimizer settings from this run's
config (``MAY_CHANGE``); what it may not change is refused in one line (``_check_compatible``). Checkpoints present
and none intact stop the run rather than start it over (``find``).
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch.distributed as dist
from megatron.core import parallel_state
from torch.distributed.checkpoint.api import CheckpointException as WriteFailure  # a BaseException, not an Exception

from stem_megatron.checkpoint import atomic, dense, disk, finite, host_tables, train_state
from stem_megatron.checkpoint.atomic import CheckpointError
from stem_megatron.config import RunConfig
from stem_megatron.config_moves import flat_stem, new_key


# train.* a resume may change, in effect from the resumed step (docs/checkpoints.md, "Rollback"); named when they do
MAY_CHANGE = ("steps", "lr", "min_lr_ratio", "warmup_ratio", "decay_style", "weight_decay", "adam_beta1",
              "adam_beta2", "clip_grad")
# train.* it may not: the data position is the step, step x global batch samples into the order the seed shuffles
FIXED = ("global_batch_size", "seed")


def root_dir(cfg: RunConfig) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.out_dir) / "checkpoints")


def _layout() -> dict:
    return {"world": dist.get_world_size(),
            "tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "ep": parallel_state.get_expert_model_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size()}


def _identity(cfg: RunConfig) -> dict:
    """What must match for a checkpoint to load: the model and which layers are STEM / where tables live. ``stem``:
    the flat dict (``config_moves.flat_stem``), the layout every checkpoint records, so all of them load; the
    calibration's fields decide only a new run's tables (``checkpoint.init_from_hf``), a resume loads them; the
    tables' state and read copies convert on load (``host_tables.load``)."""
    stem = flat_stem(*(dataclasses.asdict(group) for group in (cfg.stem, cfg.host_tables, cfg.hash_moe)))
    return {"model": dataclasses.asdict(cfg.model),
            "stem": {k: v for k, v in stem.items()
                     if k not in ("prefetch_depth", "cache_rows", "shm_dir", "host_memory_gib",
                                  "overlap_exchange", "overlap_update", "calibration_tokens",
                                  "calibration_gib", "read_dtype", "state_dtype", "second_moment", "master_dtype")}}


def save(cfg: RunConfig, trainer, detector, step: int) -> Path:
    """Write the checkpoint after ``step`` optimizer steps (collective); returns its directory. Its tensors are
    checked finite before anything is written (``finite``); a failed write leaves no partial directory, and one that
    failed for want of space or write access ends the run in one line (``disk``). Either way ``latest`` stays."""
    root, c = root_dir(cfg), cfg.checkpoint
    chain = trainer.optimizer  # the dense optimizer and the host tables' member (or their absence)
    weights = dense.state(trainer.model, chain.dense)
    tables = host_tables.state(chain.tables)
    size = finite.check([weights, tables], step, root)
    meta = {"layout": _layout(), **_identity(cfg), "train": dataclasses.asdict(cfg.train)}
    try:
        staging = atomic.staging_dir(root, step)
        dense.write(weights, staging / "dense")
        host_tables.save(chain.tables, tables, staging / "stem")
        train_state.save(staging, step, trainer.scheduler, detector)
        return atomic.commit(staging, step, meta, c.keep, c.keep_every)
    except (Exception, WriteFailure) as error:
        shutil.rmtree(atomic.staging_path(root, step), ignore_errors=True)
        line = disk.failure(error, root, step, size, atomic.latest_name(root))
        if line is None:
            raise
        raise CheckpointError(line) from None


def find(cfg: RunConfig) -> Optional[tuple[Path, dict]]:
    """The checkpoint this run resumes from, verified, and its manifest: ``checkpoint.load``, else
    ``<dir>/latest`` when ``checkpoint.resume``; None for a fresh start (collective).

    A checkpoint root (not an explicit step directory) whose newest checkpoint is damaged or missing is
    reported and the newest intact earlier one used, unless ``checkpoint.fallback=false``; nothing is
    deleted. A requeued job thus continues where an intact checkpoint exists; where checkpoints are present and
    none is intact, the run stops (``_refuse_restart``) rather than start over and save over them."""
    c = cfg.checkpoint
    if c.load and (Path(c.load) / atomic.MANIFEST).exists():  # an explicit step directory: that one or none
        _say_rollback(Path(c.load), root_dir(cfg))
        return Path(c.load), atomic.verify(Path(c.load))
    root = Path(c.load or root_dir(cfg))
    if not (c.load or c.resume):
        _say_fresh_start(root)
        return None
    found = _newest_intact(root) if c.fallback else _latest(root)
    if found is None and c.load:
        raise CheckpointError(f"checkpoint.load={c.load} holds no checkpoint")
    if found is None:
        _refuse_restart(root)
    return found


def _refuse_restart(root: Path) -> None:
    """Stop a run that would start over beside checkpoints of which none is intact. Only the staging directory of an
    unfinished first save (``.tmp-step_*``) is no checkpoint: that run starts over (saying so), as it would anyway."""
    names = atomic.leftovers(root)
    if names and all(name.startswith(".tmp-") for name in names):
        _warn(f"{root} holds only {', '.join(names)}, an unfinished save: no checkpoint to resume, starting at step 1")
    elif names:
        raise CheckpointError(
            f"{root} holds {', '.join(names[:6])}{', ...' if len(names) > 6 else ''} and no intact checkpoint (none "
            f"has its {atomic.MANIFEST}): this run would start over at step 1 and save over them. Resume from a "
            f"checkpoint with checkpoint.load=<step dir>, or start over with checkpoint.resume=false (nothing there "
            f"is deleted; each save replaces the step_* directory of its number)")


def _say_fresh_start(root: Path) -> None:
    names = atomic.leftovers(root)
    if names:
        _warn(f"checkpoint.resume=false: starting at step 1 beside {', '.join(names[:6])}"
              f"{', ...' if len(names) > 6 else ''} in {root}, of which nothing is deleted until this run saves: "
              f"each save replaces the step_* directory of its number and moves {atomic.LATEST}")


def _say_rollback(checkpoint: Path, root: Path) -> None:
    """A rollback within the run (``checkpoint.load`` of one of its own earlier checkpoints) says what stays."""
    latest, step = atomic.latest_name(root), atomic.step_of(checkpoint)
    later = latest is not None and step is not None and (atomic.step_of(latest) or 0) > step
    if later and checkpoint.resolve().parent == root.resolve():
        _warn(f"checkpoint.load={checkpoint} rolls this run back from {latest}: the later checkpoints stay, not "
              f"counted by checkpoint.keep, until this run saves over them; drop checkpoint.load from the command a "
              f"requeued job runs, or it rolls back again")


def _latest(root: Path) -> Optional[tuple[Path, dict]]:
    path = atomic.resolve(root)
    return None if path is None else (path, atomic.verify(path))


def _newest_intact(root: Path) -> Optional[tuple[Path, dict]]:
    """The checkpoint ``latest`` names, else the newest earlier one that verifies (collective)."""
    earlier = atomic.complete_checkpoints(root)
    try:
        latest = atomic.resolve(root)
    except CheckpointError as error:  # the marker names nothing usable: start from the newest sealed one
        _warn(f"{error}; looking for an earlier intact checkpoint")
        latest = None
    names = [p.name for p in earlier]  # oldest first
    if latest is not None and latest.name in names:
        earlier = earlier[:names.index(latest.name)]
    problems = []
    for path in ([latest] if latest is not None else []) + earlier[::-1]:
        try:
            return path, atomic.verify(path)
        except CheckpointError as error:
            problems.append(str(error))
            _warn(f"{error} Trying the checkpoint before it (checkpoint.fallback=false refuses instead).")
    if problems:
        raise CheckpointError(f"no intact checkpoint under {root}: " + " | ".join(problems))
    return None


def _warn(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def _check_compatible(cfg: RunConfig, manifest: dict, path: Path, layout: dict) -> None:
    """The model and STEM settings must match; the layout may differ (dense state and host tables are
    resharded) except across EP=1 and EP>1: megatron gives the experts an optimizer of their own only
    when EP > 1, and its state does not map onto the other structure."""
    want = _identity(cfg)
    # a setting added after the checkpoint was saved: it trained with what is now the default
    defaults = _identity(RunConfig())
    for part in ("model", "stem"):
        saved = {k: v for k, v in {**defaults[part], **manifest.get(part, {})}.items() if k in defaults[part]}
        diff = sorted(k for k in set(want[part]) | set(saved) if want[part].get(k) != saved.get(k))
        if diff:
            keys = [f"model.{k}" if part == "model" else new_key(k) for k in diff]
            raise CheckpointError(
                f"{path} was saved with a different {part} config ({', '.join(keys)}: "
                f"checkpoint {[saved.get(k) for k in diff]} vs this run "
                f"{[want[part].get(k) for k in diff]}); resume with the checkpoint's settings")
    trained = manifest.get("train", {})  # not in checkpoints saved before it: unknown, not compared
    fixed = [k for k in FIXED if k in trained and trained[k] != getattr(cfg.train, k)]
    if fixed:
        raise CheckpointError(
            f"{path} was trained with {', '.join(f'train.{k}={trained[k]}' for k in fixed)} and this run has "
            f"{', '.join(f'train.{k}={getattr(cfg.train, k)}' for k in fixed)}: the data position is the step (step "
            f"x global batch samples into the order train.seed shuffles), so the run would skip or repeat samples. "
            f"Resume with the checkpoint's values, or start a new run from its weights (checkpoint.init_from)")
    saved, now = manifest["layout"]["ep"], layout["ep"]
    if (saved > 1) != (now > 1):
        raise CheckpointError(
            f"{path} was saved with EP={saved} and this run has EP={now}: megatron keeps the experts' optimizer "
            f"state apart from the other parameters' only when EP > 1, so it loads between EP sizes above 1, or "
            f"at EP=1, under any TP, PP, DP size or node count. Resume with EP {'> 1' if saved > 1 else '= 1'}, "
            f"or start a new run from its weights (checkpoint.init_from)")


def load(path: Path, manifest: dict, cfg: RunConfig, trainer, detector) -> int:
    """Restore everything saved by ``save`` (``find`` verified it); returns the step to continue after
    (collective)."""
    layout = _layout()
    _check_compatible(cfg, manifest, path, layout)
    dense.load(trainer.model, trainer.optimizer.dense, path / "dense", manifest["step"])
    step = train_state.load(path, trainer.scheduler, detector, manifest["layout"], layout)
    host_tables.load(trainer.optimizer.tables, path / "stem", steps_done=step)
    dist.barrier()
    return step


def changes(cfg: RunConfig, manifest: dict) -> list[str]:
    """The ``MAY_CHANGE`` settings this run resumes with that differ from the checkpoint's, as ``train.lr 0.003 ->
    0.001``."""
    trained = manifest.get("train", {})
    return [f"train.{k} {trained[k]} -> {getattr(cfg.train, k)}" for k in MAY_CHANGE
            if k in trained and trained[k] != getattr(cfg.train, k)]


def init_weights(path: Path, cfg: RunConfig, trainer) -> None:
    """Start a new run from a checkpoint's weights and tables; optimizer, schedule and step start fresh."""
    manifest = atomic.verify(path)
    mine = dict(_identity(cfg)["model"])
    saved = {**_identity(RunConfig())["model"], **manifest["model"]}  # fields added since: their defaults
    mine.pop("seq_length"), saved.pop("seq_length")
    if mine != saved:
        raise CheckpointError(f"{path} holds a different model config; checkpoint.init_from needs the same "
                              f"model.* settings (only seq_length may differ)")
    dense.load_weights(trainer.model, path / "dense")
    trainer.optimizer.reload_model_params()
    host_tables.load(trainer.optimizer.tables, path / "stem", kinds=("weight",))
    dist.barrier()
