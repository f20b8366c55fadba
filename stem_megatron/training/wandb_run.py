"""Experiment tracking: one Weights & Biases run per job, and reading an offline run back.

``WandbTracker`` is created by the writing rank only (others pass ``enabled=False`` and every call is
a no-op). It is offline by default: the run is written under ``<run_dir>/wandb/offline-run-*`` and
uploaded later with ``wandb sync`` (see ``docs/tracking.md``); nothing reaches the network unless
``mode="online"``. wandb is imported only when the tracker is enabled. Throughput and MFU live in
``stem_megatron.flops.mfu``.

One run directory is one W&B run: its id and last logged step live in ``<run_dir>/wandb_run.json``, so a requeued or
resumed job continues that run (``resume="allow"``; offline, each job writes a directory of the same id). A job that
logs a step the run has logged already (resumed from an earlier checkpoint: a rollback) says so: ``rollback_to_step``
in the history and summary, and in the run's notes. W&B's rewind (``resume_from``) works online only.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import secrets
import string
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from stem_megatron.checkpoint.atomic import newest_before, step_of

MAX_HISTOGRAM_BINS = 512  # wandb.Histogram's limit
RUN_FILE = "wandb_run.json"  # in the run directory: the W&B run's id and last logged step


def default_run_name(config: Mapping) -> str:
    """``<model>-<variant>-<ratio>`` from a RunConfig dict, e.g. ``tiny-stem-1/3``."""
    model, stem = config.get("model", {}), config.get("stem", {})
    parts = [model.get("name"), stem.get("variant"), stem.get("ratio") if stem.get("variant") != "dense" else None]
    return "-".join(str(p) for p in parts if p) or "run"


class WandbTracker:
    """One W&B run per job: the resolved config at init, the step records, spike events, finish.

    ``log(record)`` takes the loop's step record as is: numbers are logged at ``step=record["step"]``
    (booleans as 0/1, ``None`` skipped, NaN/inf kept so a diverging run shows), the per-expert load
    ``moe_tokens_per_expert`` as a histogram over the expert index, other numeric lists as a histogram
    of their values. Flagged loss spikes (``loss_spike`` from ``SpikeDetector``) are collected and
    written at ``finish()`` as the table ``loss_spikes`` (step, loss, size, and the overrides of a rollback past it:
    ``rollback``) and in the run summary
    (``loss_spike_count``, ``loss_spike_steps``); log every spike step (the loop logs a step when
    ``record["loss_spike"]``) or the table misses the unlogged ones (the count does not).
    """

    def __init__(self, run_dir: str | os.PathLike, config_dict: Mapping, project: str = "stem-megatron",
                 mode: str = "offline", name: Optional[str] = None, tags: Iterable[str] = (),
                 enabled: bool = True, entity: Optional[str] = None, group: Optional[str] = None,
                 settings: Optional[Mapping] = None, resumed: Optional[int] = None,
                 checkpoints: Optional[Path] = None):
        """``resumed``: the step the job resumed after (0: a new run, whose W&B run is new too); None: unknown, the
        directory's W&B run continues and a rollback goes back to before its first logged step."""
        if mode not in ("offline", "online", "disabled"):
            raise ValueError(f"wandb mode {mode!r} is not 'offline', 'online' or 'disabled'")
        self.enabled = enabled and mode != "disabled"
        self.run = None
        self._checkpoints = checkpoints  # the run's checkpoint root: the spike table's rollback column
        self.spikes: list[dict] = []
        self._last_step: Optional[int] = None
        self._spike_count = 0  # the detector's running count (also spikes on steps not logged here)
        self._run_path: Optional[Path] = None
        if not self.enabled:
            return
        import wandb

        self._wandb = wandb
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self._file = Path(run_dir) / RUN_FILE
        before = json.loads(self._file.read_text()) if self._file.is_file() and resumed != 0 else {}
        self._id = before.get("id") or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        self._logged_before, self._resumed = before.get("last_step"), resumed
        self.run = wandb.init(
            dir=str(run_dir), mode=mode, project=project, entity=entity, group=group,
            name=name or default_run_name(config_dict), tags=list(tags) or None,
            config=_jsonable(config_dict), id=self._id, resume="allow",
            settings=wandb.Settings(reinit="create_new", **dict(settings or {})),
        )
        self._run_path = Path(self.run.dir).parent
        self._save_run_file()

    def _save_run_file(self) -> None:
        """``wandb_run.json``: the id and the run's highest logged step (replaced whole: a job killed mid-write leaves
        the previous file)."""
        last = max((s for s in (self._last_step, self._logged_before) if s is not None), default=None)
        part = self._file.with_suffix(".part")
        part.write_text(json.dumps({"id": self._id, "last_step": last}) + "\n")
        os.replace(part, self._file)

    def _rollback(self, step: int) -> Optional[int]:
        """At this job's first logged ``step``: the step it went back to when the W&B run has logged ``step``
        already, else None."""
        if self._last_step is not None or self._logged_before is None or step > self._logged_before:
            return None
        back = self._resumed if self._resumed is not None else step - 1
        self.run.summary["rollback_to_step"] = back
        self.run.notes = f"{self.run.notes or ''}rolled back to step {back} after step {self._logged_before}. "
        print(f"W&B run {self._id}: resumed after step {back}, before its last logged step {self._logged_before}: "
              f"steps {back + 1}-{self._logged_before} are logged again (rollback_to_step in its history and summary; "
              f"metrics.jsonl holds this job's)", flush=True)
        return back

    @property
    def run_path(self) -> Optional[Path]:
        """The local run directory (``.../wandb/offline-run-<time>-<id>``), for ``wandb sync``."""
        return self._run_path

    def log(self, record: Mapping) -> None:
        if not self.enabled:
            return
        step = int(record["step"])
        back = self._rollback(step)
        data: dict[str, Any] = {} if back is None else {"rollback_to_step": back}
        for key, value in record.items():
            if key == "step" or value is None:
                continue
            if isinstance(value, bool):
                data[key] = int(value)
            elif isinstance(value, numbers.Real):  # also numpy scalars
                data[key] = value.item() if hasattr(value, "item") else value
            elif isinstance(value, (list, tuple)):
                hist = self._histogram(key, value)
                if hist is not None:
                    data[key] = hist
            elif isinstance(value, str):
                data[key] = value
        if isinstance(record.get("loss_spike_count"), int):
            self._spike_count = max(self._spike_count, record["loss_spike_count"])
        if record.get("loss_spike"):
            loss = record.get("loss")
            self.spikes.append({"step": step, "loss": None if loss is None else float(loss),
                                "size": record.get("loss_spike_size")})
        self.run.log(data, step=step)
        self._last_step = step
        self._save_run_file()

    def _histogram(self, key: str, values) -> Any:
        if not values or not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
            return None
        wandb = self._wandb
        if key == "moe_tokens_per_expert" and len(values) <= MAX_HISTOGRAM_BINS:
            # bar per expert: bin e spans [e, e+1) and holds that expert's token count
            return wandb.Histogram(np_histogram=([float(v) for v in values], list(range(len(values) + 1))))
        finite = [float(v) for v in values if math.isfinite(v)]
        return wandb.Histogram(finite, num_bins=min(64, max(1, len(finite)))) if finite else None

    def finish(self, exit_code: int = 0) -> None:
        """Write the spike table and summary, close the run (idempotent)."""
        if not self.enabled or self.run is None:
            return
        wandb = self._wandb
        self.run.summary["loss_spike_count"] = max(self._spike_count, len(self.spikes))
        self.run.summary["loss_spike_steps"] = [s["step"] for s in self.spikes]
        if self.spikes:
            table = wandb.Table(columns=["step", "loss", "size", "rollback"],
                                data=[[s["step"], s["loss"], s["size"], self.rollback(s["step"])]
                                      for s in self.spikes])
            self.run.log({"loss_spikes": table}, step=self._last_step)
        self.run.finish(exit_code=exit_code)
        self.run = None
        self.enabled = False

    def rollback(self, step: int) -> str:
        """The usual recovery from a spike at ``step`` (PaLM, OLMo), as overrides: back to the newest sealed checkpoint
        before it, the batches from there to the spike skipped; "" without one."""
        last = newest_before(self._checkpoints, step) if self._checkpoints else None
        return f"checkpoint.load={last} train.skip_steps=[{step_of(last) + 1}-{step}]" if last else ""

    def __enter__(self) -> "WandbTracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(exit_code=0 if exc_type is None else 1)


def _jsonable(obj: Any) -> Any:
    """The config as plain JSON types (dataclass dicts may hold tuples, Fractions, Paths)."""
    return json.loads(json.dumps(obj, default=str))


# ------------------------------------------------------------------------------------------------
# Reading an offline run back (wandb's own reader of the .wandb transaction log)
# ------------------------------------------------------------------------------------------------

def inspect_offline_run(path: str | os.PathLike, summary: bool = False, timeout: float = 120.0):
    """Read a local run with ``wandb leet inspect --json`` (wandb-core's reader of ``run-*.wandb``).

    ``path``: a ``.wandb`` file or the run directory holding one. Returns the list of records (dicts
    with ``type`` = run, history, summary, exit, ...), or with ``summary=True`` one dict with the
    run's state, name, config and latest metric values. Needs no network and no login.
    """
    args = [sys.executable, "-m", "wandb", "leet", "inspect", "--json"] + (["--summary"] if summary else [])
    out = subprocess.run(args + [str(path)], capture_output=True, text=True, timeout=timeout, check=True).stdout
    if summary:
        return json.loads(out)
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def offline_history(path: str | os.PathLike) -> list[dict]:
    """The history rows of a local run (one dict per logged step, keys as logged plus ``_step``)."""
    return [r["history"]["item"] for r in inspect_offline_run(path) if r.get("type") == "history"]
