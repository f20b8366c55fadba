"""Experiment tracking: one Weights & Biases run per job, plus model-FLOPs throughput and MFU.

``WandbTracker`` is created by the writing rank only (others pass ``enabled=False`` and every call is
a no-op). It is offline by default: the run is written under ``<run_dir>/wandb/offline-run-*`` and
uploaded later with ``wandb sync`` (see ``docs/tracking.md``); nothing reaches the network unless
``mode="online"``. wandb is imported only when the tracker is enabled.

``model_flops_per_token`` / ``throughput_metrics`` give the achieved model TFLOP/s of a step and,
when the accelerator's peak is known (a GPU from ``PEAK_BF16_TFLOPS`` or an explicit value), the
model FLOPs utilisation (MFU); on CPU the MFU is ``None``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

# ------------------------------------------------------------------------------------------------
# FLOPs, TFLOP/s and MFU
# ------------------------------------------------------------------------------------------------

# Dense (no 2:4 sparsity) BF16 tensor-core peak per GPU, TFLOP/s, from the vendor data sheets.
# Matched in order against torch.cuda.get_device_name(); the first pattern found wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"GB200|B200", 2250.0),
    (r"H200", 989.0),
    (r"H100.*PCIe", 756.0),
    (r"H100.*NVL", 835.0),
    (r"H100|GH200", 989.0),
    (r"A100", 312.0),
    (r"L40S", 362.0),
    (r"\bL4\b", 121.0),
    (r"\bA10\b", 125.0),
)


def model_flops_per_token(model: Any, stem: Any = None) -> int:
    """Training (forward + backward = 3x forward) matmul FLOPs per token of the whole model, from
    ``stem_megatron.flops``' exact count (GQA-aware, attention over the full sequence, LM head; equal
    to ``torch.utils.flop_counter`` on the megatron-core model). ``model``/``stem`` are
    ``ModelConfig``/``STEMConfig`` or their dicts from config.json."""
    from stem_megatron import flops

    arch = flops.arch_from_model_config(_as_dict(model))
    variant = flops.DENSE if stem is None else flops.variant_from_stem_config(stem)
    seq = arch.seq_length
    return flops.training_flops(arch, seq, variant)["total"] // seq


def _as_dict(obj: Any) -> dict:
    return dict(obj) if isinstance(obj, Mapping) else dataclasses.asdict(obj)


def device_peak_tflops(device_name: Optional[str] = None) -> Optional[float]:
    """Dense BF16 peak TFLOP/s of one GPU, by name (default: the current CUDA device); ``None`` on
    CPU or for a GPU not in ``PEAK_BF16_TFLOPS`` (pass ``logging.peak_tflops`` explicitly then)."""
    if device_name is None:
        try:
            import torch

            if not torch.cuda.is_available():
                return None
            device_name = torch.cuda.get_device_name()
        except Exception:  # noqa: BLE001 - no usable CUDA means no known peak
            return None
    for pattern, peak in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return peak
    return None


def throughput_metrics(tokens_per_s: float, flops_per_token: float, peak_tflops: Optional[float] = None,
                       num_devices: int = 1) -> dict:
    """Achieved model TFLOP/s of the job and per device, and MFU (``None`` without a known peak).

    ``tokens_per_s`` is the job's global throughput (the loop's ``tokens_per_s``: global batch tokens
    over the step time); ``peak_tflops`` is one device's peak; ``num_devices`` the world size.
    """
    tflops = tokens_per_s * flops_per_token / 1e12
    per_device = tflops / num_devices
    mfu = per_device / peak_tflops if peak_tflops else None
    return {"tflops_per_s": tflops, "tflops_per_s_per_device": per_device, "mfu": mfu}


# ------------------------------------------------------------------------------------------------
# Weights & Biases
# ------------------------------------------------------------------------------------------------

MAX_HISTOGRAM_BINS = 512  # wandb.Histogram's limit


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
    written at ``finish()`` as the table ``loss_spikes`` (step, loss, size) and in the run summary
    (``loss_spike_count``, ``loss_spike_steps``); log every spike step (the loop logs a step when
    ``record["loss_spike"]``) or the table misses the unlogged ones (the count does not).
    """

    def __init__(self, run_dir: str | os.PathLike, config_dict: Mapping, project: str = "stem-megatron",
                 mode: str = "offline", name: Optional[str] = None, tags: Iterable[str] = (),
                 enabled: bool = True, entity: Optional[str] = None, group: Optional[str] = None,
                 settings: Optional[Mapping] = None):
        if mode not in ("offline", "online", "disabled"):
            raise ValueError(f"wandb mode {mode!r} is not 'offline', 'online' or 'disabled'")
        self.enabled = enabled and mode != "disabled"
        self.run = None
        self.spikes: list[dict] = []
        self._last_step: Optional[int] = None
        self._spike_count = 0  # the detector's running count (also spikes on steps not logged here)
        self._run_path: Optional[Path] = None
        if not self.enabled:
            return
        import wandb

        self._wandb = wandb
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            dir=str(run_dir), mode=mode, project=project, entity=entity, group=group,
            name=name or default_run_name(config_dict), tags=list(tags) or None,
            config=_jsonable(config_dict),
            settings=wandb.Settings(reinit="create_new", **dict(settings or {})),
        )
        self._run_path = Path(self.run.dir).parent

    @property
    def run_path(self) -> Optional[Path]:
        """The local run directory (``.../wandb/offline-run-<time>-<id>``), for ``wandb sync``."""
        return self._run_path

    def log(self, record: Mapping) -> None:
        if not self.enabled:
            return
        step = int(record["step"])
        data: dict[str, Any] = {}
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
            table = wandb.Table(columns=["step", "loss", "size"],
                                data=[[s["step"], s["loss"], s["size"]] for s in self.spikes])
            self.run.log({"loss_spikes": table}, step=self._last_step)
        self.run.finish(exit_code=exit_code)
        self.run = None
        self.enabled = False

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
