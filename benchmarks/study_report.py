"""docs/results.md and its plots from a study's run directories (``benchmarks/study.py`` calls this).

Reads ``<out>/<variant>/seed<s>/{metrics.jsonl,eval.json}``; every figure in the report is computed
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
from fractions import Fraction
from pathlib import Path
from typing import Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from stem_megatron.layer_plan import stem_layer_indices  # noqa: E402

# recipes/variant name -> label used in the paper's Table 3
VARIANTS = {"dense": "dense", "stem_1_3": "STEM-1/3", "stem_1_2": "STEM-1/2", "stem_full": "STEM-full",
            "stem_dagger": "STEM†", "stem_gate": "STEM-gate", "hash_moe": "Hash-MoE-1/3"}
WARMUP_STEPS = 5  # first steps (graph warm-up, first prefetches) left out of the wall time per token
# Spikes are counted after the first tenth of a run: while the loss falls from ~8 to ~5 the detector's
# baseline lags and flags the batches whose blend composition is hardest (the report lists those steps).


# ------------------------------------------------------------------------------------------ loading
def load_runs(out: Path, variants: Sequence[str], seeds: Sequence[int]) -> dict[str, list[dict]]:
    """``{variant: [run, ...]}``, a run being its eval.json plus curves from metrics.jsonl."""
    runs: dict[str, list[dict]] = {}
    for variant in variants:
        for seed in seeds:
            run_dir = out / variant / f"seed{seed}"
            for name in ("eval.json", "metrics.jsonl"):
                if not (run_dir / name).is_file():
                    raise FileNotFoundError(f"{run_dir / name} is missing: run benchmarks/study.py to finish this run")
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
            ev = json.loads((run_dir / "eval.json").read_text())
            config = json.loads((run_dir / "config.json").read_text())
            valid = [r for r in records if "valid_loss" in r]
            timed = [r for r in records if r["step"] > WARMUP_STEPS] or records
            tokens_per_step = config["train"]["global_batch_size"] * config["model"]["seq_length"]
            spike_steps = [r["step"] for r in records if r.get("loss_spike")]
            burn_in = len(records) // 10
            runs.setdefault(variant, []).append({
                **ev, "seed": seed, "config": config,
                "steps": [r["step"] for r in records], "loss": [r["loss"] for r in records],
                "spike_steps": spike_steps,
                "valid_tokens_seen": [r["tokens"] for r in valid], "valid_loss": [r["valid_loss"] for r in valid],
                "final_valid_loss": valid[-1]["valid_loss"],
                "spikes": sum(step > burn_in for step in spike_steps),
                "early_spikes": [step for step in spike_steps if step <= burn_in],
                "s_per_mtok": 1e6 * sum(r["step_time_s"] for r in timed) / (len(timed) * tokens_per_step),
            })
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


def claims(table: dict[str, dict], runs: dict[str, list[dict]], study: dict) -> list[str]:
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
                   + ("**agrees** with the paper (no separated gain)." if side != "lower" else
                      "**disagrees**: full is clearly better here."))
    ratios = [v for v in ("stem_1_3", "stem_1_2", "stem_full") if v in table and "roi" in table[v]]
    if len(ratios) >= 2:
        rois = [table[v]["roi"]["mean"] for v in ratios]
        rising = all(x < y for x, y in zip(rois, rois[1:]))
        out.append("- Training ROI grows with the replacement ratio (1.08x / 1.20x / 1.33x): "
                   + " / ".join(f"{VARIANTS[v]} {_fmt(table[v]['roi'])}" for v in ratios)
                   + (" — **agrees** with the paper (means rise)." if rising else
                      " — **disagrees** (means do not rise).")
                   + " ROI here is held-out token accuracy / training FLOPs, not downstream accuracy.")
    if have("stem_gate", "dense"):
        line("Replacing the gate instead of the up-projection underperforms dense (49.10 vs 49.72)", "stem_gate",
             "dense", "final_valid_loss", "higher")
    if have("stem_dagger", "stem_1_3"):
        side = compare(table["stem_dagger"]["final_valid_loss"], table["stem_1_3"]["final_valid_loss"])
        out.append(f"- STEM† (extra up-projection) does not improve on STEM (50.60 vs 50.90): STEM† "
                   f"{_fmt(table['stem_dagger']['final_valid_loss'], 4)} vs STEM-1/3 "
                   f"{_fmt(table['stem_1_3']['final_valid_loss'], 4)} validation loss — "
                   + ("**disagrees**: STEM† is clearly better here." if side == "lower" else
                      "**agrees** with the paper (no separated gain)."))
    if have("hash_moe", "stem_1_3"):
        moe, stem = table["hash_moe"]["spikes"], table["stem_1_3"]["spikes"]
        stems = [v for v in ("stem_1_3", "stem_1_2", "stem_full", "stem_dagger", "stem_gate") if v in table]
        stem_total = sum(sum(table[v]["spikes"]["values"]) for v in stems)
        out.append(f"- Hash-MoE shows loss spikes, STEM none (Fig. 3a): after the first tenth of the run Hash-MoE "
                   f"{_fmt(moe, 1)} spikes per run, STEM-1/3 {_fmt(stem, 1)}; {stem_total:.0f} spikes over all STEM "
                   f"runs — "
                   + ("**agrees** with the paper." if moe["min"] > stem["max"] else
                      "**not reproduced** at this scale (no variant spikes there)." if moe["max"] == 0 else
                      "**not reproduced** at this scale (Hash-MoE does not spike more than STEM)."))
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
             report: Path) -> str:
    any_run = next(iter(table.values()))
    cfg = any_run["config"]
    m, t = cfg["model"], cfg["train"]
    layers = "; ".join(f"{VARIANTS[v]} {planned(r['config'])}" for v, r in table.items() if v != "dense")
    placement = ("in host memory, updated by the DeepSpeed CPU Adam kernel (touched rows)"
                 if cfg["stem"]["placement"] == "host" else "as device parameters")
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
    text = f"""# Small-scale reproduction study

*Generated by `{study['command']}` on {datetime.date.today().isoformat()}
({study['wall_s'] / 60:.0f} min for this invocation); do not edit by hand — rerun the command.*

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

## Against the paper
{chr(10).join(claims(table, runs, study))}

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


def write_report(out: Path, report: Path, study: dict) -> dict:
    runs = load_runs(out, study["variants"], study["seeds"])
    table = aggregate(runs)
    figures = plot(runs, table, report.parent / "results")
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(markdown(table, runs, study, figures, report))
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
