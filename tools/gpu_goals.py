"""What ``make gpu-check`` measures against: the GPU step's goals (docs/gpu.md) as ratios of one machine's runs, and
summary.md (the goals table, each part's status and seconds against its plan, the audits' lines).
``tools/gpu_check.py`` runs the parts; this file reads what they wrote."""

from __future__ import annotations

from typing import Optional

# (figure, model, numerator variant, denominator variant, what is compared, at most, goal): the acceptance
# bounds; none where only the figure is asked for. 1B's STEM-full is not run: its tables (189 GB) exceed the host.
GOALS = (
    ("STEM-1/3 working set, lazy / dense", "1B-3L", "stem_1_3_resident_lazy", "dense", "step_time_s", 1.00, 0.95),
    ("STEM-1/3 host, lazy Adam / dense", "1B-3L", "stem_1_3_host_lazy", "dense", "step_time_s", 1.00, 0.95),
    ("STEM-full working set, lazy / dense", "1B-3L", "stem_full_resident_lazy", "dense", "step_time_s", 0.90, 0.85),
    ("STEM-1/3 host / device tables", "1B-3L", "stem_1_3_host_lazy", "stem_1_3_device", "step_time_s", 1.05, None),
    ("STEM-full host / dense", "1B-3L", "stem_full_host", "dense", "step_time_s", 0.90, 0.85),
    ("STEM-1/3 working set, dense Adam / dense", "1B-3L", "stem_1_3_resident_dense", "dense", "step_time_s", None,
     None),
    ("STEM-1/3 host, dense Adam / dense", "1B-3L", "stem_1_3_host_dense", "dense", "step_time_s", None, None),
    ("STEM-1/3 working set, lazy / dense", "1B", "stem_1_3_resident_lazy", "dense", "step_time_s", 1.00, 0.95),
    ("STEM-1/3 working set, lazy / dense", "350M", "stem_1_3_resident_lazy", "dense", "step_time_s", 1.00, 0.95),
    ("STEM-1/3 working set peak / dense peak", "1B", "stem_1_3_resident_lazy", "dense", "peak_memory_bytes", 1.10,
     None),
    ("STEM-1/3 working set within dense + 10%, lazy / dense", "1B", "stem_1_3_resident_fit", "dense", "step_time_s",
     1.00, 0.95),
    ("STEM-1/3 working set within dense + 10%, peak / dense peak", "1B", "stem_1_3_resident_fit", "dense",
     "peak_memory_bytes", 1.10, None),
    ("STEM-1/3 working set within dense + 10%, lazy / dense", "350M", "stem_1_3_resident_fit", "dense",
     "step_time_s", 1.00, 0.95),
    ("STEM-1/3 host, lazy Adam / dense", "1B", "stem_1_3_host_lazy", "dense", "step_time_s", 1.00, 0.95),
    ("STEM-1/3 host, lazy Adam / dense", "350M", "stem_1_3_host_lazy", "dense", "step_time_s", 1.00, 0.95),
    ("STEM-1/3 host peak / dense peak", "1B", "stem_1_3_host_lazy", "dense", "peak_memory_bytes", 1.10, None),
    ("STEM-full working set, lazy / dense", "350M", "stem_full_resident_lazy", "dense", "step_time_s", 0.90, 0.85),
    ("STEM-full host / dense", "350M", "stem_full_host", "dense", "step_time_s", 0.90, 0.85),
    ("STEM-1/3 working set, dense Adam / dense", "1B", "stem_1_3_resident_dense", "dense", "step_time_s", None, None),
    ("STEM-1/3 host, dense Adam / dense", "1B", "stem_1_3_host_dense", "dense", "step_time_s", None, None),
    ("STEM-1/3 host / device tables", "1B", "stem_1_3_host_lazy", "stem_1_3_device", "step_time_s", 1.05, None),
    ("STEM-1/3 host / device tables", "350M", "stem_1_3_host_lazy", "stem_1_3_device", "step_time_s", 1.05, None),
)
LAYER_GOAL = ("STEM layer / dense FFN, forward + backward", 0.75, 0.67)
FEW_LAYERS = ("1B-3L: the 1B recipe's widths with 3 of its 16 layers (STEM-1/3: 1 STEM layer, STEM-full: 2), a STEM "
              "layer against a dense one; the LM head is a larger share of the step than at 16 layers, each ratio "
              "nearer 1")


def goal_rows(results: dict, baseline: Optional[dict] = None, planned: Optional[set] = None) -> list[dict]:
    """Each goal's measured ratio (None with the reason where a run is missing or failed), whether it is met (None
    where the goal has no bound), and the baseline's ratio where one is given. ``results``: {"records": gpu_step's
    records, "layer": stem_layer's results}; ``planned``: the (model, variant) runs of the command's parts, whose
    goals are listed unmeasured too (the others only once measured)."""

    def ratio(res, model, top, bottom, key) -> tuple[Optional[float], str]:
        by = {r["variant"]: r for r in res.get("records", []) if r["model"] == model}
        missing = [v for v in (top, bottom) if v not in by or by[v]["status"] != "ok" or by[v].get(key) is None]
        if missing:
            run = by.get(missing[0])
            return None, f"{missing[0]}: {run['status'] if run else 'not run'}" + (
                f" ({run['note']})" if run and run.get("note") else "")
        return by[top][key] / by[bottom][key], ""

    def layer_ratio(res, model) -> tuple[Optional[float], str]:
        found = [r for r in res.get("layer", []) if r["model"] == model]
        return (found[0]["over_dense"]["stem"], "") if found else (None, "layer: not run")

    rows = []
    for figure, model, top, bottom, key, most, goal in GOALS:
        measured = ratio(results, model, top, bottom, key)
        if measured[0] is None and planned is not None and not {(model, top), (model, bottom)} <= planned:
            continue
        rows.append((f"{model} {figure}", *measured, most, goal,
                     ratio(baseline, model, top, bottom, key)[0] if baseline else None))
    for model in ("350M", "1B"):
        figure, most, goal = LAYER_GOAL
        rows.append((f"{model} {figure}", *layer_ratio(results, model), most, goal,
                     layer_ratio(baseline, model)[0] if baseline else None))
    return [{"figure": figure, "value": value, "why": why, "at_most": most, "goal": goal,
             "met": None if value is None or most is None else value <= most, "before": before}
            for figure, value, why, most, goal, before in rows]


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}x"


def summary(rows: list[dict], parts: dict, audits: dict, baseline: bool) -> str:
    """summary.md: the goals table, each part's status and seconds against its plan, then the audits' lines."""
    head = "| figure | " + ("before | " if baseline else "") + "measured | at most | goal | met |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        cells = [r["figure"], *([_fmt(r["before"])] if baseline else []), _fmt(r["value"]) + (
            f" ({r['why']})" if r["why"] else ""), _fmt(r["at_most"]), _fmt(r["goal"]), met]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", FEW_LAYERS, "", "| part | status | seconds | planned |", "|---|---|---|---|"]
    for name, p in parts.items():
        seconds = "-" if p.get("seconds") is None else f"{p['seconds']:.0f}"
        lines.append(f"| {name} | {p['status']} | {seconds} | {p.get('planned', '-')} |")
    lines += ["", *(f"- {line}" for line in audits.values())]
    return "\n".join(lines) + "\n"
