"""docs/results.md and its plots from a study's run directories (``benchmarks/study.py`` calls this).

Reads ``<out>/<arm>/<setting>/seed<s>/{metrics.jsonl,eval.json,study.json}``; every figure in the report is computed
here from those files. With few seeds a difference is called *separated* only when every seed of one
variant is on the same side of every seed of the other (min/max do not overlap); otherwise it is
*within seed spread*, and the report says so rather than declaring a winner.

Run alone to regenerate the report from existing runs: ``python benchmarks/study_report.py --out runs/study``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
from fractions import Fraction
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's stem_megatron, installed or not
from stem_megatron.setup_check import require_environment, require_extra  # noqa: E402

require_environment()  # before torch and megatron: another Python gets `make setup`, not a traceback
require_extra("plots")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from study_arms import ABLATION, VARIANTS  # noqa: E402

from stem_megatron.config_moves import upgrade_saved_config  # noqa: E402
from stem_megatron.layer_plan import stem_layer_indices  # noqa: E402

WARMUP_STEPS = 5  # first steps (graph warm-up, first prefetches) left out of the wall time per token
# Spikes are counted after the first tenth of a run: while the loss falls from ~8 to ~5 the detector's
# baseline lags and flags the batches whose blend composition is hardest (the report lists those steps).


# ------------------------------------------------------------------------------------------ loading

CONVERSION = "<!-- conversion-study: begin -->"  # the section benchmarks/conversion_study.py writes, kept
LEAN = "<!-- lean-study: begin -->", "<!-- lean-study: end -->"  # the lean arm's section (study_lean.py), kept

def load_run(run_dir: Path) -> dict:
    """A run's scores (eval.json, if scored), status (study.json) and curves (metrics.jsonl)."""
    for name in ("study.json", "metrics.jsonl", "config.json"):
        if not (run_dir / name).is_file():
            raise FileNotFoundError(f"{run_dir / name} is missing: run benchmarks/study.py to finish this run")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    ev = json.loads((run_dir / "eval.json").read_text()) if (run_dir / "eval.json").is_file() else {}
    config = upgrade_saved_config(json.loads((run_dir / "config.json").read_text()))  # runs in the flat stem layout too
    valid = [r for r in records if "valid_loss" in r]
    timed = [r for r in records if r["step"] > WARMUP_STEPS] or records
    tokens_per_step = config["train"]["global_batch_size"] * config["model"]["seq_length"]
    spike_steps = [r["step"] for r in records if r.get("loss_spike")]
    burn_in = config["train"]["steps"] // 10
    later = [r["loss"] for r in records if r["step"] > burn_in]
    status = json.loads((run_dir / "study.json").read_text())
    return {
        **ev, "config": config, "status": status["status"], "error": status.get("error"),
        "machine_s": status.get("machine_s", 0.0),
        "steps": [r["step"] for r in records], "loss": [r["loss"] for r in records],
        "spike_steps": spike_steps,
        "valid_tokens_seen": [r["tokens"] for r in valid], "valid_loss": [r["valid_loss"] for r in valid],
        "final_valid_loss": valid[-1]["valid_loss"] if valid else None,
        "spikes": sum(step > burn_in for step in spike_steps),
        "early_spikes": [step for step in spike_steps if step <= burn_in],
        "max_loss": max(later) if later else None, "final_loss": records[-1]["loss"] if records else None,
        "s_per_mtok": 1e6 * sum(r["step_time_s"] for r in timed) / (len(timed) * tokens_per_step) if timed else None,
    }


def load_arm(out: Path, arm: dict) -> dict[str, list[dict]]:
    """``{setting: [run per seed]}`` of one arm (``settings.json``'s entry), settings in sweep order."""
    runs: dict[str, list[dict]] = {}
    for name in arm["runs"]:
        setting, seed = name.rsplit("/seed", 1)
        runs.setdefault(setting, []).append({**load_run(out / name), "seed": int(seed)})
    return runs


# ------------------------------------------------------------------------------------------ statistics
def summary(values: Sequence[Optional[float]]) -> Optional[dict]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals), "values": vals}


def compare(a: dict, b: dict) -> str:
    """``a`` vs ``b`` summaries: "lower"/"higher" if separated (every seed on one side), "within" if the
    seed ranges overlap, "single" when either has one seed (no spread to judge by)."""
    if min(len(a["values"]), len(b["values"])) < 2:
        return "single"
    if a["max"] < b["min"]:
        return "lower"
    if a["min"] > b["max"]:
        return "higher"
    return "within"


def aggregate(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per variant: summaries of the scalar results, Training ROI normalised to dense's mean."""
    table = {}
    for variant, rs in runs.items():
        table[variant] = {key: summary([r[key] for r in rs]) for key in (
            "final_valid_loss", "valid_accuracy", "fact_recall", "edit_success", "edit_flips",
            "edit_stays", "spikes",
            "s_per_mtok", "train_flops")}
        table[variant].update(config=rs[0]["config"], fact_majority=rs[0]["fact_majority"],
                              params_total=rs[0]["params_total"], params_active=rs[0]["params_active"],
                              flops_per_token=rs[0]["flops_per_token"],
                              train_tokens=rs[0]["train_tokens"])
    if "dense" in table:
        base = table["dense"]["valid_accuracy"]["mean"] / table["dense"]["train_flops"]["mean"]
        for variant, rs in runs.items():
            table[variant]["roi"] = summary([r["valid_accuracy"] / r["train_flops"] / base for r in rs])
    return table


# ------------------------------------------------------------------------------------------ plots
def _band(ax, runs: list[dict], xkey: str, ykey: str, label: str, scale: float = 1.0, flops: bool = False):
    """Mean curve over seeds with the min-max band."""
    per = runs[0]["flops_per_token"] if flops else 1
    xs = [x * per / scale for x in runs[0][xkey]]
    ys = list(zip(*[r[ykey] for r in runs]))
    mean = [statistics.fmean(y) for y in ys]
    line, = ax.plot(xs[:len(mean)], mean, label=label)
    ax.fill_between(xs[:len(mean)], [min(y) for y in ys], [max(y) for y in ys], color=line.get_color(), alpha=0.2)


def _smooth(values: list[float], k: int = 10) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc = v if i == 0 else (1 - 1 / k) * acc + v / k
        out.append(acc)
    return out


def _save(fig, axes, path: Path) -> Path:
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(runs: dict[str, list[dict]], table: dict[str, dict], figures: Path) -> dict[str, Path]:
    figures.mkdir(parents=True, exist_ok=True)
    paths = {}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for variant, rs in runs.items():
        _band(axes[0], rs, "valid_tokens_seen", "valid_loss", VARIANTS[variant], scale=1e6)
        _band(axes[1], rs, "valid_tokens_seen", "valid_loss", VARIANTS[variant], scale=1e12, flops=True)
    axes[0].set(xlabel="training tokens (M)", ylabel="validation loss", title="validation loss vs tokens")
    axes[1].set(xlabel="training FLOPs (TFLOP)", ylabel="validation loss", title="validation loss vs training FLOPs")
    paths["valid"] = _save(fig, axes, figures / "valid_loss.png")

    fig, ax = plt.subplots(figsize=(12, 4.5))
    top = 0.0
    for variant, rs in runs.items():
        for i, r in enumerate(rs):
            smooth = _smooth(r["loss"])
            top = max(top, *smooth[len(smooth) // 10:])
            line, = ax.plot(r["steps"], smooth, lw=0.8, alpha=0.8, label=VARIANTS[variant] if i == 0 else None,
                            color=None if i == 0 else ax.lines[-1].get_color())
            spikes = [r["loss"][r["steps"].index(s)] for s in r["spike_steps"]]
            ax.scatter(r["spike_steps"], spikes, color=line.get_color(), marker="x", s=30)
    ax.set(xlabel="step", ylabel="training loss (EMA 10)", title="training loss, every seed (x: flagged spikes)")
    ax.set_ylim(top=1.05 * top)  # the first tenth of the run (loss ~8) would flatten the rest
    paths["train"] = _save(fig, [ax], figures / "train_loss.png")

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = list(runs)
    for ax, key, title in zip(axes, ("fact_recall", "edit_success", "roi"),
                              ("fact recall", "edit top-1 success (swap rows)", "Training ROI (dense = 1)")):
        for i, variant in enumerate(names):
            s = table[variant].get(key)
            if s is None:
                continue
            ax.bar(i, s["mean"], color=f"C{i}", alpha=0.6)
            ax.scatter([i] * len(s["values"]), s["values"], color="k", s=12, zorder=3)
        ax.set_xticks(range(len(names)), [VARIANTS[v] for v in names], rotation=35, ha="right", fontsize=8)
        ax.set_title(title)
    majority = next(iter(table.values()))["fact_majority"]
    axes[0].axhline(majority, color="k", ls="--", lw=0.8, label="most common answer")
    paths["bars"] = _save(fig, axes, figures / "knowledge_roi.png")
    return paths


# ------------------------------------------------------------------------------------------ report
def _fmt(s: Optional[dict], digits: int = 3, pct: bool = False) -> str:
    if s is None:
        return "–"
    f = (lambda v: f"{100 * v:.{max(digits - 2, 0)}f}%") if pct else (lambda v: f"{v:.{digits}f}")
    if len(s["values"]) == 1:
        return f(s["mean"])
    return f"{f(s['mean'])} [{f(s['min'])}, {f(s['max'])}]"


def _verdict(side: str, expected: str) -> str:
    if side == "single":
        return "**one seed**: no spread to judge by, no verdict"
    if side == "within":
        return "**within seed spread** (no separated difference)"
    return "**agrees** with the paper" if side == expected else "**disagrees** with the paper"


def _no_gain_verdict(side: str, what: str) -> str:
    if side == "single":
        return "**one seed**: no spread to judge by, no verdict."
    return (f"**disagrees**: {what} is clearly better here." if side == "lower" else
            "**agrees** with the paper (no separated gain).")


def stress_claim(stress: dict[str, list[dict]], study: dict) -> str:
    """Fig. 3a (Hash-MoE's loss spikes, none for STEM) at ``stress_lr``: spikes after the first tenth per run."""
    per = {v: [r["spikes"] for r in rs] for v, rs in stress.items()}
    died = {v: sum(r["status"] == "diverged" for r in rs) for v, rs in stress.items()}
    text = (f"- Hash-MoE shows loss spikes, STEM none (Fig. 3a), at lr {study['stress_lr']:g} "
            f"({study['stress_lr'] / study['base_lr']:g}x the recipe's peak): spikes per run "
            + ", ".join(f"{VARIANTS[v]} {per[v]}" + (f" ({died[v]} diverged)" if died[v] else "") for v in per))
    if "hash_moe" not in per or "stem_1_3" not in per:
        return text + " — needs Hash-MoE and STEM-1/3 in the stress arm, no verdict."
    moe, stem = summary(per["hash_moe"]), summary(per["stem_1_3"])
    side = compare(moe, stem)
    if side == "single":
        return text + " — **one seed**: no spread to judge by, no verdict."
    if side == "higher" and stem["max"] == 0:
        return text + " — **agrees** with the paper (every Hash-MoE run spikes more than every STEM-1/3 run, " \
                      "which has none)."
    if side == "higher":
        return text + " — **partly**: Hash-MoE spikes more in every seed, but STEM-1/3 spikes too."
    if moe["max"] == 0 and stem["max"] == 0:
        return text + " — **not reproduced** at this scale (no spikes at this lr)."
    return text + " — **not reproduced** at this scale (Hash-MoE does not spike more than STEM-1/3 in every seed)."


def claims(table: dict[str, dict], runs: dict[str, list[dict]], study: dict,
           stress: Optional[dict[str, list[dict]]] = None) -> list[str]:
    """The paper's claims this study can test, each with the measured comparison and a verdict."""
    out = []

    def have(*vs):
        return all(v in table for v in vs)

    def line(claim, a, b, key, expected, fmt=lambda s: _fmt(s, 4)):
        side = compare(table[a][key], table[b][key])
        word = {"lower": "below", "higher": "above", "within": "overlapping", "single": "one seed"}[side]
        out.append(f"- {claim}: {VARIANTS[a]} {fmt(table[a][key])} vs {VARIANTS[b]} {fmt(table[b][key])} "
                   f"({key}: {word}) — {_verdict(side, expected)}.")

    if have("stem_1_3", "dense"):
        line("STEM-1/3 beats dense at equal tokens (Table 3: 50.90 vs 49.72 avg)", "stem_1_3", "dense",
             "final_valid_loss", "lower")
        line("… measured as held-out next-token accuracy", "stem_1_3", "dense", "valid_accuracy", "higher")
    if have("stem_1_2", "stem_1_3"):
        line("More STEM layers help: STEM-1/2 beats STEM-1/3 (54.20 vs 50.90)", "stem_1_2", "stem_1_3",
             "final_valid_loss", "lower")
    if have("stem_full", "stem_1_2"):
        side = compare(table["stem_full"]["final_valid_loss"], table["stem_1_2"]["final_valid_loss"])
        out.append(f"- Gains slow beyond 1/2 (STEM-full 53.43 vs STEM-1/2 54.20): STEM-full "
                   f"{_fmt(table['stem_full']['final_valid_loss'], 4)} vs STEM-1/2 "
                   f"{_fmt(table['stem_1_2']['final_valid_loss'], 4)} validation loss — "
                   + _no_gain_verdict(side, "full"))
    ratios = [v for v in ("stem_1_3", "stem_1_2", "stem_full") if v in table and "roi" in table[v]]
    if len(ratios) >= 2:
        sides = [compare(table[b]["roi"], table[a]["roi"]) for a, b in zip(ratios, ratios[1:])]
        verdict = ("**one seed**: no spread to judge by, no verdict" if "single" in sides else
                   "**agrees** with the paper (each step up separated)" if all(x == "higher" for x in sides) else
                   "**disagrees** (a step down, separated)" if "lower" in sides else
                   "**within seed spread** for at least one step (means: "
                   + ("rising" if all(table[a]["roi"]["mean"] < table[b]["roi"]["mean"]
                                      for a, b in zip(ratios, ratios[1:])) else "not rising") + ")")
        out.append("- Training ROI grows with the replacement ratio (1.08x / 1.20x / 1.33x): "
                   + " / ".join(f"{VARIANTS[v]} {_fmt(table[v]['roi'])}" for v in ratios)
                   + f" — {verdict}. ROI here is held-out token accuracy / training FLOPs, not downstream accuracy.")
    if have("stem_gate", "dense"):
        line("Replacing the gate instead of the up-projection underperforms dense (49.10 vs 49.72)", "stem_gate",
             "dense", "final_valid_loss", "higher")
    if have("stem_dagger", "stem_1_3"):
        side = compare(table["stem_dagger"]["final_valid_loss"], table["stem_1_3"]["final_valid_loss"])
        out.append(f"- STEM† (extra up-projection) does not improve on STEM (50.60 vs 50.90): STEM† "
                   f"{_fmt(table['stem_dagger']['final_valid_loss'], 4)} vs STEM-1/3 "
                   f"{_fmt(table['stem_1_3']['final_valid_loss'], 4)} validation loss — "
                   + _no_gain_verdict(side, "STEM†"))
    if stress:
        out.append(stress_claim(stress, study))
    elif have("hash_moe", "stem_1_3"):
        out.append(f"- Loss spikes at the recipe's lr (Fig. 3a is tested by the stress arm, not run here): Hash-MoE "
                   f"{_fmt(table['hash_moe']['spikes'], 1)}, STEM-1/3 {_fmt(table['stem_1_3']['spikes'], 1)} per run.")
    stems = [v for v in ("stem_1_3", "stem_1_2", "stem_full") if v in table]
    if "dense" in table and stems:
        for v in stems:
            line(f"STEM stores more facts than dense ({VARIANTS[v]})", v, "dense", "fact_recall", "higher",
                 fmt=lambda s: _fmt(s, 3, pct=True))
    if have("hash_moe", "stem_1_3"):
        line("STEM vs Hash-MoE at a similar total parameter count: fact recall", "stem_1_3", "hash_moe", "fact_recall",
             "higher", fmt=lambda s: _fmt(s, 3, pct=True))
    edits = [v for v in table if table[v]["edit_success"] is not None]
    if edits:
        out.append("- Swapping two subjects' rows moves the prediction to the other subject's answer (Fig. 5, one "
                   "example in the paper): " + ", ".join(f"{VARIANTS[v]} {_fmt(table[v]['edit_success'], 3, True)}"
                                                         for v in edits)
                   + " of prompts (top-1); the other answer becomes more likely than the prompt's own in "
                   + ", ".join(f"{_fmt(table[v]['edit_flips'], 3, True)}" for v in edits)
                   + "; the prompt keeps its own answer as top-1 in "
                   + ", ".join(f"{_fmt(table[v]['edit_stays'], 3, True)}" for v in edits) + ".")
    early = sorted({s for rs in runs.values() for r in rs for s in r["early_spikes"]})
    if early:
        gbs = next(iter(table.values()))["config"]["train"]["global_batch_size"]
        blend = Fraction(study["facts_share"], 100).denominator  # samples after which the source order repeats
        period = math.lcm(blend, gbs) // gbs
        periodic = all((b - a) % period == 0 for a, b in zip(early, early[1:]))
        out.append(f"- In the first tenth of the runs the spike detector flagged steps {early}; these are not counted "
                   "above. The loss is still falling from ~8 to ~5 there"
                   + (f", and the flagged steps are {period} steps apart, the period at which the blend's fixed order "
                      f"of sources ({blend} samples) lines up with the {gbs}-sample batches again: the flags "
                      "follow the batches' composition, not an instability." if periodic else "."))
    return out


def planned(config: dict) -> str:
    """0-based replaced layers of a run's config."""
    stem = config["stem"]
    return str(stem_layer_indices(config["model"]["num_layers"], stem["ratio"], stem["layers"]))


def markdown(table: dict[str, dict], runs: dict[str, list[dict]], study: dict, figures: dict[str, Path],
             report: Path, ablation: Optional[dict] = None, stress: Optional[dict] = None) -> str:
    any_run = next(iter(table.values()))
    cfg = any_run["config"]
    m, t = cfg["model"], cfg["train"]
    layers = "; ".join(f"{VARIANTS[v]} {planned(r['config'])}" for v, r in table.items() if v != "dense")
    placement = ("in host memory, updated by the DeepSpeed CPU Adam kernel (touched rows)"
                 if cfg["host_tables"]["placement"] == "host" else "as device parameters")
    rel = {k: os.path.relpath(p, report.parent) for k, p in figures.items()}
    seeds = ", ".join(map(str, study["seeds"]))
    head = ("| variant | total params | active params | FLOPs/token | train FLOPs | valid loss (end) | "
            "held-out acc | ROI | fact recall | edit top-1 | edit flips | spikes after 1/10 | s / M tokens |")
    rows = [head, "|" + "---|" * 13]
    for variant, row in table.items():
        rows.append(
            f"| {VARIANTS[variant]} | {row['params_total'] / 1e6:.2f}M | {row['params_active'] / 1e6:.2f}M | "
            f"{row['flops_per_token'] / 1e6:.2f}M | {row['train_flops']['mean'] / 1e12:.2f}T | "
            f"{_fmt(row['final_valid_loss'], 4)} | {_fmt(row['valid_accuracy'], 3, True)} | "
            f"{_fmt(row.get('roi'), 3)} | "
            f"{_fmt(row['fact_recall'], 3, True)} | {_fmt(row['edit_success'], 3, True)} | "
            f"{_fmt(row['edit_flips'], 3, True)} | {_fmt(row['spikes'], 1)} | "
            f"{_fmt(row['s_per_mtok'], 0)} |")
    arm_sections = ""
    if ablation:
        seeds_ab = ", ".join(study["arms"]["ablation"]["swept"]["train.seed"])
        arm_sections += (f"\n## Ablation: STEM-1/3 init x clipping x optimizer\n"
                         f"{', '.join(f'`{k}`' for k in ABLATION)}; seeds {seeds_ab}, the main arm's tokens and lr.\n\n"
                         f"{ablation_section(ablation)}\n\n"
                         f"![ablation]({rel['ablation']})\n")
    if stress:
        lr = study["stress_lr"]
        arm_sections += (f"\n## Stress: lr {lr:g} ({lr / study['base_lr']:g}x the recipe's peak)\n"
                         f"{', '.join(VARIANTS[v] for v in stress)}, {study['arms']['stress']['steps']} steps each, "
                         "the same warm-up and cosine decay; spikes as above.\n\n"
                         f"{stress_section(stress)}\n\n![stress]({rel['stress']})\n")
    text = f"""# Small-scale reproduction study

*Generated by `{study['command']}` on {datetime.date.today().isoformat()}
({study['wall_s'] / 60:.0f} min for this invocation); do not edit by hand — rerun the command.*

## How to run
{how_to_run(study, {"main": runs, "ablation": ablation or {}, "stress": stress or {}})}

## Setup
- Model `{m['name']}`: {m['num_layers']} layers, d={m['hidden_size']}, d_ff={m['ffn_hidden_size']}, \
{m['num_attention_heads']} heads, V={m['vocab_size']}, {m['seq_length']}-token sequences, untied embeddings.
  Variants from recipes/variant/; STEM and Hash-MoE layers per variant: {layers}.
- Every run: {study['steps']} steps of {t['global_batch_size']} × {m['seq_length']} tokens = \
{any_run['train_tokens'] / 1e6:.2f}M tokens, lr {t['lr']:g} ({t['decay_style']}, warm-up {t['warmup_ratio']:g}), \
STEM tables {placement}; seeds {seeds} (model init and data order); one process per run, {study['jobs']} runs \
side by side, {study['threads']} torch thread(s) each.
- Data: the python3.11-doc corpus ({100 - study['facts_share']}% of samples) blended with synthetic facts
  ({study['facts_share']}%): {study['subjects']} subjects, each "The capital of X is Y." with one of
  {study['answers']} answers (X, Y single-token words of the corpus tokenizer), every fact {study['repeats']}
  times in the facts corpus. Always answering the most common answer would score \
{100 * any_run['fact_majority']:.1f}% recall.
- Validation loss: python-doc valid split, every {max(1, study['steps'] // 10)} steps. Held-out accuracy:
  top-1 next-token accuracy of the exported model on that split. Fact recall: share of subjects whose top-1
  continuation of "The capital of X is" is their answer. Edit success: for up to 100 pairs of recalled
  subjects with different answers, swap their rows at every STEM layer and count prompts whose top-1 is
  now the other subject's answer (edit top-1) and prompts where the other answer now outscores their own
  (edit flips); each swap is undone before the next.
- Training ROI = held-out accuracy / training FLOPs, normalised to dense's mean (the paper divides
  downstream accuracy by FLOPs). FLOPs are the exact matmul count of `stem_megatron.flops` (fwd + bwd).
- Spikes: the training loop's detector (docs/tracking.md: loss more than 4 std above a detrended
  100-step baseline), counted after the first tenth of the run. Wall time: mean seconds per million
  tokens after step {WARMUP_STEPS}, with {study['jobs']} runs sharing the machine — compare variants within
  this table only.
- Figures are `mean [min, max]` over the seeds. A difference is *separated* only when the seeds' ranges
  do not overlap; everything else is reported as within seed spread.

## Results
{chr(10).join(rows)}

![validation loss]({rel['valid']})

![training loss]({rel['train']})

![fact recall, edit success, ROI]({rel['bars']})
{arm_sections}
## Against the paper
{chr(10).join(claims(table, runs, study, stress))}

## Limits of this study
- {any_run['train_tokens'] / 1e6:.1f}M tokens on a {m['num_layers']}-layer, d={m['hidden_size']} model is far \
below the paper's 350M/1B models
  on billions of tokens; the paper's effects are measured on downstream accuracy, here on held-out
  loss/accuracy and on a synthetic fact task. Two or three seeds bound the noise only roughly.
- STEM's extra capacity is per token id: a table row learns only from the tokens with that id, so with
  {any_run['train_tokens'] / 1e6:.1f}M tokens over V={m['vocab_size']} ids most rows see few updates.
- Edit rates here come from models that learned the facts alongside text; `benchmarks/knowledge_edit.py`
  (docs/benchmarks.md) measures them on models trained on facts alone, across STEM depth and row scale.
"""
    return text


# ------------------------------------------------------------------------------------------ ablation, stress
def ablation_label(setting: str) -> str:
    """``scaled-global-lazy`` -> ``scaled / global / lazy (defaults)``."""
    values = setting.split("-")
    default = values == [v[0] for v in ABLATION.values()]
    return " / ".join(values) + (" (defaults)" if default else "")


def paired_differences(ablation: dict[str, list[dict]], factor: int, level: str, default: str) -> list[float]:
    """Final validation loss at ``level`` minus at ``default`` of ``factor``, one difference per pair of runs
    with the same seed and the same other settings (same data order and backbone init)."""
    diffs = []
    for setting, rs in ablation.items():
        values = setting.split("-")
        if values[factor] != default:
            continue
        partner = ablation.get("-".join(values[:factor] + [level] + values[factor + 1:]), [])
        at = {r["seed"]: r["final_valid_loss"] for r in partner}
        diffs += [at[r["seed"]] - r["final_valid_loss"] for r in rs
                  if r["final_valid_loss"] is not None and at.get(r["seed"]) is not None]
    return diffs


def paired_line(key: str, level: str, default: str, diffs: list[float]) -> str:
    """One factor's verdict by the sign of its paired differences: "better"/"worse" only when every pair
    agrees (by chance 2 / 2^n for n pairs, two-sided), else "no consistent difference"."""
    lower, higher = sum(d < 0 for d in diffs), sum(d > 0 for d in diffs)
    n = len(diffs)
    s = summary(diffs)
    if n >= 2 and lower == n:
        word = f"**better** than the default in every pair (by chance: 2/2^{n} = {2 / 2 ** n:.1%})"
    elif n >= 2 and higher == n:
        word = f"**worse** than the default in every pair (by chance: 2/2^{n} = {2 / 2 ** n:.1%})"
    else:
        word = "**no consistent difference** from the default"
    return (f"- `{key}={level}` vs `{default}` (the default), final validation loss over {n} pairs of runs "
            f"(same seed and other settings): difference {s['mean']:+.4f} [{s['min']:+.4f}, {s['max']:+.4f}], "
            f"lower in {lower} and higher in {higher} of {n} pairs: {word}.")


def ablation_section(ablation: dict[str, list[dict]]) -> str:
    """The 8 settings' table and, per factor, its level against the default in pairs of runs that differ in
    that factor only: the seed moves the loss more than the factors do, and a pair shares its seed."""
    rows = ["| init / clip / optimizer | valid loss (end) | held-out acc | fact recall | spikes after 1/10 | "
            "s / M tokens |", "|---|---|---|---|---|---|"]
    for setting, rs in ablation.items():
        s = {k: summary([r.get(k) for r in rs]) for k in ("final_valid_loss", "valid_accuracy", "fact_recall",
                                                         "spikes", "s_per_mtok")}
        rows.append(f"| {ablation_label(setting)} | {_fmt(s['final_valid_loss'], 4)} | "
                    f"{_fmt(s['valid_accuracy'], 3, True)} | {_fmt(s['fact_recall'], 3, True)} | "
                    f"{_fmt(s['spikes'], 1)} | {_fmt(s['s_per_mtok'], 0)} |")
    lines = []
    for i, (key, (default, level)) in enumerate(ABLATION.items()):
        diffs = paired_differences(ablation, i, level, default)
        if diffs:
            lines.append(paired_line(key, level, default, diffs))
    return "\n".join(rows) + "\n\n" + "\n".join(lines)


def stress_section(stress: dict[str, list[dict]]) -> str:
    """One row per stress run: spikes, the highest loss after the first tenth, the last loss, diverged."""
    rows = ["| variant | seed | spikes after 1/10 | flagged steps | max loss after 1/10 | last loss | diverged |",
            "|---|---|---|---|---|---|---|"]
    for variant, rs in stress.items():
        for r in rs:
            first = r["loss"][0] if r["loss"] else math.nan
            diverged = (f"yes: {r['error']} (after step {r['steps'][-1] if r['steps'] else 0})"
                        if r["status"] == "diverged" else
                        "yes: non-finite loss" if any(not math.isfinite(x) for x in r["loss"]) else
                        "yes: last loss above the first" if r["final_loss"] >= first else "no")
            rows.append(f"| {VARIANTS[variant]} | {r['seed']} | {r['spikes']} | {r['spike_steps'] or '–'} | "
                        f"{r['max_loss']:.3f} | {r['final_loss']:.3f} | {diverged} |")
    return "\n".join(rows)


def plot_arms(ablation: Optional[dict], stress: Optional[dict], figures: Path) -> dict[str, Path]:
    """The ablation's final validation loss per setting (every seed a dot) and the stress runs' training loss."""
    paths = {}
    if ablation:
        fig, ax = plt.subplots(figsize=(10, 4))
        for i, (setting, rs) in enumerate(ablation.items()):
            vals = [r["final_valid_loss"] for r in rs if r["final_valid_loss"] is not None]
            ax.bar(i, statistics.fmean(vals), color=f"C{i}", alpha=0.6)
            ax.scatter([i] * len(vals), vals, color="k", s=12, zorder=3)
            ax.set_ylim(bottom=0.98 * min(vals) if i == 0 else min(ax.get_ylim()[0], 0.98 * min(vals)))
        ax.set_xticks(range(len(ablation)), [ablation_label(s).replace(" (defaults)", "*") for s in ablation],
                      rotation=30, ha="right", fontsize=8)
        ax.set(ylabel="final validation loss", title="STEM-1/3 ablation: init / clip / optimizer (* defaults)")
        paths["ablation"] = _save(fig, [ax], figures / "ablation.png")
    if stress:
        fig, ax = plt.subplots(figsize=(12, 4.5))
        for i, (variant, rs) in enumerate(stress.items()):
            for j, r in enumerate(rs):
                ax.plot(r["steps"], r["loss"], lw=0.7, alpha=0.8, color=f"C{i}", label=VARIANTS[variant] if j == 0
                        else None)
                ax.scatter(r["spike_steps"], [r["loss"][r["steps"].index(s)] for s in r["spike_steps"]],
                           color=f"C{i}", marker="x", s=30)
        ax.set(xlabel="step", ylabel="training loss", title="stress arm: training loss, every seed (x: flagged spikes)")
        paths["stress"] = _save(fig, [ax], figures / "stress_loss.png")
    return paths


def how_to_run(study: dict, loaded: dict[str, dict[str, list[dict]]]) -> str:
    """The command, the arms as sweep commands, the token budget and the time it took: the sweeps' wall time,
    summed over every run's share, whichever invocation ran it (a rerun keeps runs finished earlier)."""
    arms = study["arms"]
    budget = ", ".join(f"{name} {len(a['runs'])} runs x {a['steps']} steps" for name, a in arms.items())
    minutes = {name: sum(r["machine_s"] for rs in loaded[name].values() for r in rs) / 60 for name in arms}
    per_arm = ", ".join(f"{name} {m:.0f}" for name, m in minutes.items())
    lines = [f"`{study['command']}` ran {sum(len(a['runs']) for a in arms.values())} runs ({budget}; 16 x 128 "
             f"tokens per step, {study['jobs']} runs side by side, each one process with {study['threads']} torch "
             f"thread(s)) in {sum(minutes.values()):.0f} min of sweeps ({per_arm}), plus scoring and "
             "plotting. Each arm is a Hydra sweep, cut into sweeps of "
             f"{study['jobs']} jobs run by the `submitit_local` launcher (it starts every job of a sweep at once); "
             "the arm's whole sweep, as a user would type it:"]
    for name, a in arms.items():
        lines.append(f"- {name}: `{a['command']}`")
    return "\n".join(lines)


def write_report(out: Path, report: Path, study: dict) -> dict:
    """The report of the arms in ``study`` (``settings.json``); the main arm is required (setup, claims)."""
    loaded = {name: load_arm(out / name, arm) for name, arm in study["arms"].items()}
    if "main" not in loaded:
        raise ValueError("the report needs the main arm (its setup and the paper's claims)")
    runs, ablation, stress = loaded["main"], loaded.get("ablation"), loaded.get("stress")
    study = {**study, "base_lr": next(iter(runs.values()))[0]["config"]["train"]["lr"]}  # the stress arm's reference
    table = aggregate(runs)
    figures = report.parent / "results"
    paths = {**plot(runs, table, figures), **plot_arms(ablation, stress, figures)}
    report.parent.mkdir(parents=True, exist_ok=True)
    kept = report.read_text() if report.is_file() else ""  # the sections written on their own, appended after it
    starts = [kept.index(marker) for marker in (CONVERSION, LEAN[0]) if marker in kept]
    kept = kept[min(starts):] if starts else ""
    report.write_text(markdown(table, runs, study, paths, report, ablation, stress) + ("\n" + kept if kept else ""))
    (out / "results.json").write_text(json.dumps({"study": study, "table": table}, indent=1))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/study"))
    parser.add_argument("--report", type=Path, default=Path("docs/results.md"))
    args = parser.parse_args()
    study = json.loads((args.out / "settings.json").read_text())
    write_report(args.out, args.report, study)
    print(f"wrote {args.report}")


if __name__ == "__main__":
    main()
