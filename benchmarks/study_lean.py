"""The lean arm's section of docs/results.md: the STEM tables' lean optimizer states (recipes/table_state/*.yaml)
against the paper's fp32 AdamW, for STEM-1/3 and STEM-full (``benchmarks/study.py --arms lean`` calls this).

The section sits between its own markers (``LEAN`` in study_report.py): the arm runs without the main arm, a rerun
replaces the section in place, and the main report's rewrite keeps it. A lean run and its fp32 partner share the
seed, so the data order and the initial weights: they differ in the table state alone, and the verdict reads the
difference within each pair against the spread the seed alone makes. The states between fp32 and lean (moments,
bf16_master) change one part of it each, so a difference lean makes can be laid at one part's door.

Run alone to rewrite the section from existing runs: ``python benchmarks/study_lean.py --out runs/study``.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from study_arms import LEAN_VARIANTS, TABLE_STATES, VARIANTS
from study_report import LEAN, _fmt, load_arm, summary

from stem_megatron.flops.state_bytes import per_parameter, read_dtype
from stem_megatron.table_state import StateSpec

FP32 = next(iter(TABLE_STATES))
# the paired lines' scores: name, scale, digits, unit
PAIRED = {"final_valid_loss": ("final validation loss", 1, 4, ""), "fact_recall": ("fact recall", 100, 1, " pp")}


def state_keys(runs: dict[str, list[dict]], variant: str, state: str) -> str:
    """The ``host_tables`` keys a ``state`` run sets apart from its fp32 partner, as overrides."""
    fp32 = runs[f"{variant}-{FP32}"][0]["config"]["host_tables"]
    other = runs[f"{variant}-{state}"][0]["config"]["host_tables"]
    return ", ".join(f"`host_tables.{k}={v}`" for k, v in other.items() if fp32.get(k) != v) or \
        "no `host_tables` key apart from fp32's"


def host_bytes(run: dict) -> float:
    """Host bytes per table parameter of a run's table state at its width, as ``stem-flops --memory`` plans them."""
    h = SimpleNamespace(**run["config"]["host_tables"])
    spec = StateSpec.of(h)
    return per_parameter(spec, read_dtype(h, spec), run["config"]["model"]["ffn_hidden_size"], tp=1)["host"]


def paired_line(variant: str, state: str, runs: dict[str, list[dict]], key: str) -> Optional[str]:
    """``key`` (a ``PAIRED`` score) state - fp32 per seed, and a plain reading: "lower"/"higher in every pair" or
    no consistent difference, and whether the differences stay within fp32's seed spread (its max - min)."""
    name, scale, digits, unit = PAIRED[key]
    fp32 = {r["seed"]: r.get(key) for r in runs.get(f"{variant}-{FP32}", [])}
    other = {r["seed"]: r.get(key) for r in runs.get(f"{variant}-{state}", [])}
    seeds = sorted(s for s in fp32 if fp32[s] is not None and other.get(s) is not None)
    if not seeds:
        return None
    diffs = [scale * (other[s] - fp32[s]) for s in seeds]
    n, lower, higher = len(diffs), sum(d < 0 for d in diffs), sum(d > 0 for d in diffs)
    spread = scale * (max(fp32[s] for s in seeds) - min(fp32[s] for s in seeds))
    mags = summary([abs(d) for d in diffs])
    if n < 2:
        verdict = "**one seed**: no spread to judge by, no verdict"
    else:
        if lower == n or higher == n:
            sign = (f"**{'lower' if lower == n else 'higher'} in every pair** by {mags['mean']:.{digits}f}{unit} "
                    f"[{mags['min']:.{digits}f}, {mags['max']:.{digits}f}] (by chance: 2/2^{n} = {2 / 2 ** n:.1%})")
        else:
            sign = f"**no consistent difference** (lower in {lower} and higher in {higher} of {n} pairs)"
        side = "within" if mags["max"] <= spread else "beyond"
        verdict = f"{sign}; {side} fp32's seed spread ({spread:.{digits}f}{unit})"
    per_seed = ", ".join(f"seed {s} {d:+.{digits}f}" for s, d in zip(seeds, diffs))
    return (f"- {VARIANTS[variant]}, {TABLE_STATES[state]} − fp32, {name}{unit and f' ({unit.strip()})'}: "
            f"{per_seed} (mean {sum(diffs) / n:+.{digits}f}): {verdict}.")


def lean_section(runs: dict[str, list[dict]], study: dict) -> str:
    """The section, markers included: per variant x table state with runs the main table's loss, knowledge and
    speed columns, then each state's keys and bytes, its paired differences from fp32 and the sweep command."""
    arm = study["arms"]["lean"]
    cells = [(v, s) for v in LEAN_VARIANTS for s in TABLE_STATES if f"{v}-{s}" in runs]
    rows = ["| variant | table state | valid loss (end) | held-out acc | fact recall | spikes after 1/10 | "
            "s / M tokens |", "|---|---|---|---|---|---|---|"]
    for variant, state in cells:
        s = {k: summary([r.get(k) for r in runs[f"{variant}-{state}"]]) for k in (
            "final_valid_loss", "valid_accuracy", "fact_recall", "spikes", "s_per_mtok")}
        rows.append(f"| {VARIANTS[variant]} | {TABLE_STATES[state]} | {_fmt(s['final_valid_loss'], 4)} | "
                    f"{_fmt(s['valid_accuracy'], 3, True)} | {_fmt(s['fact_recall'], 3, True)} | "
                    f"{_fmt(s['spikes'], 1)} | {_fmt(s['s_per_mtok'], 0)} |")
    states = []
    for state in TABLE_STATES:
        variant = next((v for v, s in cells if s == state and (v, FP32) in cells), None)
        if variant:
            keys = "the recipes' default" if state == FP32 else state_keys(runs, variant, state)
            states.append(f"- `table_state={state}` (recipes/table_state/{state}.yaml: {keys}): "
                          f"{host_bytes(runs[f'{variant}-{state}'][0]):.2f} B of host memory per table parameter")
    lines = [line for v, s in cells if s != FP32 for key in PAIRED if (line := paired_line(v, s, runs, key))]
    return f"""{LEAN[0]}
## Table optimizer state: lean settings against fp32 AdamW

*Generated by `{study['command']}` on {datetime.date.today().isoformat()}; rerun it to replace this section (the
main report's rewrite keeps it).*

The tables' optimizer states against the paper's fp32 AdamW (`table_state=fp32`), {arm['steps']} steps at the
main arm's tokens and lr, seeds {', '.join(arm['swept']['train.seed'])}; bytes at the runs' width (`d_ff`), as
`stem-flops --memory` plans them:
{chr(10).join(states)}

Columns as in the main table, `mean [min, max]` over the seeds.

{chr(10).join(rows)}

Final validation loss and fact recall (percentage points) in pairs of runs with the same seed (data order and
initial weights):
{chr(10).join(lines)}

The arm's sweep: `{arm['command']}`
{LEAN[1]}"""


def write_lean(out: Path, report: Path, study: dict) -> str:
    """The lean arm's section of ``study`` (``<out>/lean/settings.json``) in place of the one in ``report``,
    appended when there is none."""
    section = lean_section(load_arm(out / "lean", study["arms"]["lean"]), study)
    text = report.read_text() if report.is_file() else ""
    if LEAN[0] in text:
        text = text[:text.index(LEAN[0])] + section + text[text.index(LEAN[1]) + len(LEAN[1]):]
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + section + "\n"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(text)
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/study"))
    parser.add_argument("--report", type=Path, default=Path("docs/results.md"))
    args = parser.parse_args()
    write_lean(args.out, args.report, json.loads((args.out / "lean" / "settings.json").read_text()))
    print(f"wrote the lean arm's section of {args.report}")


if __name__ == "__main__":
    main()
