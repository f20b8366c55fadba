"""Plot loss (loss spikes marked), grad norm and learning rate vs step of one or more runs side by side.

    .venv/bin/python tools/plot_metrics.py runs/tiny-dense-0-* runs/tiny-stem-1_3-* --out compare.png

Each RUN_DIR holds ``metrics.jsonl`` (one record per logged step, written by the training loop) and
``config.json``; a run is labelled by its ``stem.variant`` and ``stem.ratio`` (``dense`` for dense),
or by ``--labels``. Spikes are the records' ``loss_spike`` flags (``SpikeDetector`` in the loop);
records written before that field existed are run through ``SpikeDetector`` here (``--detect``
forces this, with ``--spike-window/-k/-warmup/-detrend``). Finite spikes are crosses on the loss curve, a
non-finite loss a dotted vertical line. When a run directory's ``metrics.jsonl`` holds several
attempts (the file is appended to, so a restarted run starts again at step 1), the last is plotted.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's stem_megatron, installed or not
from stem_megatron.setup_check import require_environment, require_extra  # noqa: E402

require_environment()  # before torch and megatron: another Python gets `make setup`, not a traceback
require_extra("plots")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from stem_megatron.training.spikes import SpikeDetector  # noqa: E402


def read_records(run_dir: Path) -> list[dict]:
    """The last attempt's records of ``run_dir/metrics.jsonl`` (a step not above the previous one
    starts a new attempt). Non-JSON lines (a torn last line of a killed run) are skipped."""
    attempts: list[list[dict]] = [[]]
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if attempts[-1] and record["step"] <= attempts[-1][-1]["step"]:
                attempts.append([])
            attempts[-1].append(record)
    return attempts[-1]


def run_label(run_dir: Path) -> str:
    """``stem.variant``-``stem.ratio`` from config.json (``dense`` alone), else the directory name."""
    try:
        cfg = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return run_dir.name
    stem = cfg.get("stem") or {}
    variant = stem.get("variant")
    if not variant:
        return run_dir.name
    if variant == "dense":
        return "dense"
    if stem.get("layers") is not None:
        return f"{variant} layers {stem['layers']}"
    return f"{variant}-{stem.get('ratio')}" if stem.get("ratio") else variant


def mark_spikes(records: list[dict], detect: bool, window: int, k: float, warmup: int,
                detrend: bool = False) -> list[dict]:
    """Records with ``loss_spike`` set: kept as logged, or computed when missing / ``detect``."""
    if not detect and all("loss_spike" in r for r in records):
        return records
    detector = SpikeDetector(window=window, k=k, warmup=warmup, detrend=detrend)
    return [{**r, **detector.update(r.get("loss"))} for r in records]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def plot_runs(run_dirs: list[Path], out: Path, labels: Optional[list[str]] = None, detect: bool = False,
              window: int = 100, k: float = 4.0, warmup: int = 20, title: Optional[str] = None,
              detrend: bool = False) -> dict:
    """Draw the figure into ``out``; returns per label the number of records and of spikes drawn."""
    fig, (ax_loss, ax_gn, ax_lr) = plt.subplots(1, 3, figsize=(17, 4.8))
    summary: dict[str, dict] = {}
    labels = labels or [run_label(d) for d in run_dirs]
    seen: dict[str, int] = {}
    for i, (run_dir, label) in enumerate(zip(run_dirs, labels)):
        if label in seen:  # two runs of the same variant: tell them apart by directory
            label = f"{label} ({run_dir.name})"
        seen[label] = i
        records = mark_spikes(read_records(run_dir), detect, window, k, warmup, detrend)
        color = f"C{i % 10}"
        steps = [r["step"] for r in records]
        ax_loss.plot(steps, [r["loss"] if _finite(r.get("loss")) else math.nan for r in records],
                     color=color, lw=1.2, label=label)
        spikes = [r for r in records if r.get("loss_spike")]
        finite = [r for r in spikes if _finite(r.get("loss"))]
        if finite:
            ax_loss.scatter([r["step"] for r in finite], [r["loss"] for r in finite], marker="x", s=70,
                            linewidths=2, color=color, zorder=5,
                            label=f"{label}: {len(finite)} loss spike{'s' * (len(finite) != 1)}")
        for j, r in enumerate(r for r in spikes if not _finite(r.get("loss"))):
            ax_loss.axvline(r["step"], color=color, ls=":", lw=1.2,
                            label=f"{label}: non-finite loss" if j == 0 else None)
        gn = [(r["step"], r["grad_norm"]) for r in records if _finite(r.get("grad_norm"))]
        if gn:
            ax_gn.plot(*zip(*gn), color=color, lw=1.0, label=label)
        lr = [(r["step"], r["lr"]) for r in records if _finite(r.get("lr"))]
        if lr:
            ax_lr.plot(*zip(*lr), color=color, lw=1.2, label=label)
        summary[label] = {"records": len(records), "spikes": len(spikes)}

    ax_loss.set_title("training loss (x: loss spike)")
    ax_loss.set_ylabel("loss")
    ax_gn.set_title("gradient norm (before clipping)")
    gn_values = [y for line in ax_gn.get_lines() for y in line.get_ydata()]
    if gn_values and min(gn_values) > 0 and max(gn_values) / min(gn_values) > 20:  # spans decades: log
        ax_gn.set_yscale("log")
    ax_lr.set_title("learning rate")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    for ax in (ax_loss, ax_gn, ax_lr):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return summary


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    p.add_argument("--out", type=Path, default=Path("plot.png"), help="PNG to write (default plot.png)")
    p.add_argument("--labels", nargs="+", help="one label per RUN_DIR instead of the config's variant")
    p.add_argument("--title")
    p.add_argument("--detect", action="store_true", help="recompute spikes even if the records have them")
    p.add_argument("--spike-window", type=int, default=100)
    p.add_argument("--spike-k", type=float, default=4.0)
    p.add_argument("--spike-warmup", type=int, default=20)
    p.add_argument("--spike-detrend", action="store_true", help="SpikeDetector(detrend=True): quadratic baseline")
    args = p.parse_args(argv)
    for d in args.run_dirs:
        if not (d / "metrics.jsonl").is_file():
            p.error(f"{d}: no metrics.jsonl (is it a run's out_dir?)")
    if args.labels and len(args.labels) != len(args.run_dirs):
        p.error(f"--labels: {len(args.labels)} labels for {len(args.run_dirs)} run directories")
    summary = plot_runs(args.run_dirs, args.out, args.labels, args.detect, args.spike_window, args.spike_k,
                        args.spike_warmup, args.title, args.spike_detrend)
    for label, s in summary.items():
        print(f"{label}: {s['records']} steps, {s['spikes']} loss spikes")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
