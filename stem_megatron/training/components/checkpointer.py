"""The run's checkpoints: the one it resumes from, and a save after a step where one is due, by step
(``checkpoint.save_interval``, this job's last step), by time (``checkpoint.save_interval_min``) or by a signal
(``preemption.py``: every rank learns both of these at one step); a stop by a signal leaves ``stopped.json`` for the
launcher and says so in one line. The checkpoint itself: ``checkpoint/manager.py``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from stem_megatron.checkpoint import manager as checkpoints
from stem_megatron.checkpoint.atomic import CheckpointError, resolve
from stem_megatron.checkpoint.hf.load import init_from_hf
from stem_megatron.config import RunConfig
from stem_megatron.training.preemption import Decision
from stem_megatron.training.setup import Trainer
from stem_megatron.training.spikes import SpikeDetector
from stem_megatron.training.train_state import TrainState

STOPPED = "stopped.json"  # in out_dir while the run is stopped by a signal: the launcher requeues such a job


class Checkpointer:
    def __init__(self, cfg: RunConfig, trainer: Trainer, detector: SpikeDetector):
        """``detector``: the spike statistics a checkpoint keeps with the step (``checkpoint/train_state.py``)."""
        self.cfg, self.trainer, self.detector = cfg, trainer, detector
        self.rank0 = dist.get_rank() == 0
        self.stopped_file = Path(cfg.out_dir) / STOPPED

    def resume(self) -> int:
        """Load the checkpoint this run continues from (or the weights it starts from: ``checkpoint.init_from``, or a
        Hugging Face model, ``checkpoint.init_from_hf``); returns its step
        (collective). An earlier job's ``stopped.json`` goes: this job resumed from its checkpoint."""
        step, steps = self._load(), self.cfg.train.steps
        if self.rank0:
            if step >= steps:
                print(f"nothing to train: the checkpoint is at step {step} of train.steps={steps} (for a new run, "
                      f"set checkpoint.resume=false or another out_dir)", flush=True)
            self.stopped_file.unlink(missing_ok=True)
        return step

    def _load(self) -> int:
        cfg = self.cfg
        found = checkpoints.find(cfg)
        if found is not None:
            path, manifest = found
            step = checkpoints.load(path, manifest, cfg, self.trainer, self.detector)
            changed = checkpoints.changes(cfg, manifest)
            if self.rank0:
                print(f"resumed from {path} after step {step}"
                      f"{'; from step ' + str(step + 1) + ': ' + ', '.join(changed) if changed else ''}", flush=True)
            return step
        if cfg.checkpoint.init_from:
            source = resolve(Path(cfg.checkpoint.init_from))
            if source is None:
                raise CheckpointError(f"checkpoint.init_from={cfg.checkpoint.init_from} holds no checkpoint")
            checkpoints.init_weights(source, cfg, self.trainer)
            if self.rank0:
                print(f"initialised weights and STEM tables from {source}", flush=True)
        if cfg.checkpoint.init_from_hf:
            source = init_from_hf(cfg, self.trainer)
            if self.rank0:
                tables = {"from_dense": ", STEM tables from a calibration pass over data.dir"}
                print(f"initialised weights from the Hugging Face model {source}"
                      f"{tables.get(cfg.stem.table_init, '')}", flush=True)
        return 0

    def should_save(self, state: TrainState, decided: Decision) -> bool:
        c, step = self.cfg.checkpoint, state.step
        return c.save and (step == state.last or (bool(c.save_interval) and step % c.save_interval == 0)
                           or decided.save_due or decided.stop is not None)

    def save(self, state: TrainState, decided: Decision) -> Optional[Path]:
        """The checkpoint after ``state.step`` where ``should_save`` (collective), else None."""
        if not self.should_save(state, decided):
            return None
        saved = checkpoints.save(self.cfg, self.trainer, self.detector, state.step)
        state.saved_at = time.monotonic()
        if self.rank0:
            print(f"saved checkpoint {saved}", flush=True)
        return saved

    def stops(self, state: TrainState, decided: Decision, saved: Optional[Path]) -> bool:
        """Whether a signal ends this job after ``state.step`` (not after its last step: that ends it anyway); if so,
        ``stopped.json`` and one line (rank 0) name the step, the signal and ``saved``, where the rerun resumes."""
        if decided.stop is None or state.step >= state.last:
            return False
        state.stopped = state.step
        if self.rank0:
            self.stopped_file.write_text(json.dumps({"step": state.step, "signal": decided.stop.name,
                                                     "checkpoint": str(saved) if saved else None}))
            where = (f"checkpoint {saved}; the same command resumes there" if saved else
                     "no checkpoint (checkpoint.save=false)")
            print(f"stopped after step {state.step} on {decided.stop.name}: {where}", flush=True)
        return True

    def due(self, state: TrainState) -> bool:
        """Whether a save is due by time (this rank's clock: the ranks agree on it at the next step)."""
        minutes = self.cfg.checkpoint.save_interval_min
        return minutes > 0 and time.monotonic() - state.saved_at >= 60 * minutes
