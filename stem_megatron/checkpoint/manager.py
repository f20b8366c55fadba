"""Save and resume a whole run: dense state, host tables, schedule, RNG, in one atomic directory.

    step_000020/
      manifest.json      sizes + CRC32 of every file, the step, the layout and model it was saved with
      dense/             megatron dist-checkpointing: weights and megatron optimizer state
      stem/              host-resident U_l and Adam moments by (layer, d_ff columns), dist-checkpointing
      train_state.pt     step, LR schedule, spike-detector statistics
      rng/               per-rank RNG states
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Optional

import torch.distributed as dist
from megatron.core import parallel_state

from stem_megatron.checkpoint import atomic, dense, host_tables, train_state
from stem_megatron.checkpoint.atomic import CheckpointError
from stem_megatron.config import RunConfig
from stem_megatron.config_moves import flat_stem, new_key


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
    the flat dict of before issue 54 (``config_moves.flat_stem``), so checkpoints saved before it still load; the
    calibration's fields decide only a new run's tables (``checkpoint.init_from_hf``), a resume loads them."""
    stem = flat_stem(*(dataclasses.asdict(group) for group in (cfg.stem, cfg.host_tables, cfg.hash_moe)))
    return {"model": dataclasses.asdict(cfg.model),
            "stem": {k: v for k, v in stem.items()
                     if k not in ("prefetch_depth", "cache_rows", "shm_dir", "host_memory_gib",
                                  "overlap_exchange", "overlap_update", "calibration_tokens",
                                  "calibration_gib")}}


def save(cfg: RunConfig, trainer, detector, step: int) -> Path:
    """Write the checkpoint after ``step`` optimizer steps (collective); returns its directory."""
    staging = atomic.staging_dir(root_dir(cfg), step)
    dense.save(trainer.model, trainer.dense_optimizer, staging / "dense")
    if trainer.store is not None:
        host_tables.save(trainer.store, staging / "stem")
    train_state.save(staging, step, trainer.scheduler, detector)
    meta = {"layout": _layout(), **_identity(cfg)}
    return atomic.commit(staging, step, meta, cfg.checkpoint.keep)


def find(cfg: RunConfig) -> Optional[tuple[Path, dict]]:
    """The checkpoint this run resumes from, verified, and its manifest: ``checkpoint.load``, else
    ``<dir>/latest`` when ``checkpoint.resume``; None for a fresh start (collective).

    A checkpoint root (not an explicit step directory) whose newest checkpoint is damaged or missing is
    reported and the newest intact earlier one used, unless ``checkpoint.fallback=false``; nothing is
    deleted. A requeued job thus continues where an intact checkpoint exists."""
    c = cfg.checkpoint
    if c.load and (Path(c.load) / atomic.MANIFEST).exists():  # an explicit step directory: that one or none
        return Path(c.load), atomic.verify(Path(c.load))
    if not (c.load or c.resume):
        return None
    root = Path(c.load or root_dir(cfg))
    found = _newest_intact(root) if c.fallback else _latest(root)
    if found is None and c.load:
        raise CheckpointError(f"checkpoint.load={c.load} holds no checkpoint")
    return found


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
        saved = {**defaults[part], **manifest.get(part, {})}
        diff = sorted(k for k in set(want[part]) | set(saved) if want[part].get(k) != saved.get(k))
        if diff:
            keys = [f"model.{k}" if part == "model" else new_key(k) for k in diff]
            raise CheckpointError(
                f"{path} was saved with a different {part} config ({', '.join(keys)}: "
                f"checkpoint {[saved.get(k) for k in diff]} vs this run "
                f"{[want[part].get(k) for k in diff]}); resume with the checkpoint's settings")
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
    dense.load(trainer.model, trainer.dense_optimizer, path / "dense", manifest["step"])
    step = train_state.load(path, trainer.scheduler, detector, manifest["layout"], layout)
    if trainer.store is not None:
        host_tables.load(trainer.store, path / "stem", steps_done=step)
    dist.barrier()
    return step


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
    if trainer.store is not None:
        host_tables.load(trainer.store, path / "stem", kinds=("weight",))
    dist.barrier()
