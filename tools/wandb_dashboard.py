"""Create the saved W&B report that puts the variants' loss, loss spikes and grad norm side by side.

    .venv/bin/python tools/wandb_dashboard.py --dry-run                 # print the spec (no network)
    .venv/bin/python tools/wandb_dashboard.py --dry-run --viewspec      # + the W&B report JSON it becomes
    .venv/bin/python tools/wandb_dashboard.py --entity ENT --project stem-megatron   # create it (online)

The report is defined by ``DASHBOARD`` below (sections of panels over the runs of one project, grouped
by ``config.stem.variant`` and ``config.stem.ratio`` so each variant is one line, the mean of its runs)
and built with the W&B Report API, ``wandb_workspaces.reports.v2`` (the ``dashboards`` extra).
Saving needs ``wandb login`` and network access; ``--dry-run`` needs neither: with ``--viewspec`` it
builds the full report model offline, answering the one server lookup ``save`` would make (the
project's internal id) with a placeholder, and prints the spec JSON that ``save`` would upload.
The metric names are the step-record keys the training loop logs through ``WandbTracker``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's stem_megatron, installed or not

DASHBOARD: dict[str, Any] = {
    "title": "STEM variants: loss, loss spikes, grad norm",
    "description": "Runs of this project grouped by STEM variant and ratio (one line per variant: the "
                   "mean of its runs, shaded min-max). Made by tools/wandb_dashboard.py; see docs/tracking.md.",
    "groupby": ["config.stem.variant", "config.stem.ratio"],
    "sections": [
        {
            "heading": "Loss and loss spikes",
            "text": "A loss spike is a step whose loss exceeds the mean of the previous non-spike steps "
                    "(with logging.spike_detrend: a quadratic fit of them) by spike_k standard deviations "
                    "(SpikeDetector over spike_window steps, after spike_warmup), or a non-finite loss. "
                    "loss_spike_count rises by one at each spike; loss_spike_size is only logged on spike "
                    "steps (in standard deviations).",
            "panels": [
                {"type": "line", "title": "training loss", "y": ["loss"]},
                {"type": "line", "title": "loss spikes so far", "y": ["loss_spike_count"]},
                {"type": "line", "title": "loss spike size (std units, spike steps only)", "y": ["loss_spike_size"]},
                {"type": "bar", "title": "loss spikes per run", "metrics": ["loss_spike_count"]},
            ],
        },
        {
            "heading": "Optimisation",
            "text": "Gradient norm before clipping (log scale) and the learning-rate schedule.",
            "panels": [
                {"type": "line", "title": "gradient norm (all; host tables: dense and STEM parts)",
                 "y": ["grad_norm", "dense_grad_norm", "stem_grad_norm"], "log_y": True},
                {"type": "line", "title": "learning rate", "y": ["lr"]},
            ],
        },
        {
            "heading": "Throughput",
            "text": "Global tokens/s; model TFLOP/s per device and MFU (logged when the loop computes them; "
                    "MFU only on GPUs with a known peak).",
            "panels": [
                {"type": "line", "title": "tokens/s", "y": ["tokens_per_s"]},
                {"type": "line", "title": "model TFLOP/s per device", "y": ["tflops_per_s_per_device"]},
                {"type": "line", "title": "MFU", "y": ["mfu"]},
                {"type": "line", "title": "step time (s)", "y": ["step_time_s"]},
            ],
        },
        {
            "heading": "Sparse layers",
            "text": "STEM host tables (stem_*) and Hash-MoE expert load (moe_*), where the variant has them.",
            "panels": [
                {"type": "line", "title": "STEM rows fetched per step", "y": ["stem_rows_fetched"]},
                {"type": "line", "title": "STEM prefetch wait (s)", "y": ["stem_prefetch_wait_s"]},
                {"type": "line", "title": "STEM bytes between nodes (per node)",
                 "y": ["stem_node_bytes_sent", "stem_node_bytes_received"]},
                {"type": "line", "title": "STEM rows CPU Adam updated (per node)", "y": ["stem_node_rows_updated"]},
                {"type": "line", "title": "STEM row exchange: time in it, time the step waited (s)",
                 "y": ["stem_exchange_s", "stem_exchange_wait_s"]},
                {"type": "line", "title": "MoE max/mean expert load", "y": ["moe_load_max_over_mean"]},
            ],
        },
        {
            "heading": "Configurations",
            "text": "Config keys that differ between the runs.",
            "panels": [{"type": "run_comparer", "diff_only": True}],
        },
    ],
}

_PROJECT_ID_PLACEHOLDER = "<looked up online>"


def build_report(spec: dict, entity: str, project: str, filters: str = ""):
    """The ``wandb_workspaces`` Report of ``spec`` (not saved)."""
    import wandb_workspaces.reports.v2 as wr

    def runset():
        return wr.Runset(entity=entity, project=project, name="variants", filters=filters,
                         groupby=list(spec["groupby"]))

    def panel(p: dict):
        kind = p["type"]
        if kind == "line":
            return wr.LinePlot(title=p["title"], x="Step", y=list(p["y"]), log_y=p.get("log_y"),
                               groupby_aggfunc="mean", groupby_rangefunc="minmax")
        if kind == "bar":
            return wr.BarPlot(title=p["title"], metrics=list(p["metrics"]), orientation="v")
        if kind == "run_comparer":
            return wr.RunComparer(diff_only=p.get("diff_only"))
        raise ValueError(f"unknown panel type {kind!r} in the dashboard spec")

    blocks: list = []
    for section in spec["sections"]:
        blocks.append(wr.H2(section["heading"]))
        if section.get("text"):
            blocks.append(wr.P(section["text"]))
        blocks.append(wr.PanelGrid(runsets=[runset()], panels=[panel(p) for p in section["panels"]]))
    return wr.Report(project=project, entity=entity, title=spec["title"], description=spec["description"],
                     blocks=blocks)


def offline_viewspec(spec: dict, entity: str, project: str, filters: str = "") -> dict:
    """The report spec JSON that ``Report.save()`` would upload, built with no network: the run sets'
    project-id lookup (the only server call ``_to_model`` makes) is answered with a placeholder."""
    from wandb_workspaces.reports.v2 import interface

    def fake_graphql(_api, query, variables):
        if query is interface.gql.projectInternalId:
            return {"project": {"internalId": _PROJECT_ID_PLACEHOLDER}}
        raise RuntimeError("offline: only the project-id lookup is answered")

    saved = interface.execute_graphql, interface._get_api
    interface.execute_graphql, interface._get_api = fake_graphql, lambda: None
    try:
        model = build_report(spec, entity, project, filters)._to_model()
        return json.loads(model.spec.model_dump_json(by_alias=True, exclude_none=True))
    finally:
        interface.execute_graphql, interface._get_api = saved


def panel_metrics(spec: dict) -> set[str]:
    """Every metric name the spec's panels read."""
    out: set[str] = set()
    for section in spec["sections"]:
        for p in section["panels"]:
            out.update(p.get("y", []), p.get("metrics", []))
    return out


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entity", help="W&B entity (user or team); required to save")
    p.add_argument("--project", default="stem-megatron", help="the project the training runs log to")
    p.add_argument("--title", help="report title (default: the spec's)")
    p.add_argument("--filters", default="", help="wandb_workspaces run filter, e.g. \"Config('train.seed') = 1234\"")
    p.add_argument("--draft", action="store_true", help="save as a draft")
    p.add_argument("--dry-run", action="store_true", help="print the spec; do not contact W&B")
    p.add_argument("--viewspec", action="store_true", help="with --dry-run: also the report JSON it becomes")
    args = p.parse_args(argv)
    spec = copy.deepcopy(DASHBOARD)
    if args.title:
        spec["title"] = args.title
    if args.viewspec or not args.dry_run:  # these build the report with wandb_workspaces
        from stem_megatron.setup_check import require_environment, require_extra

        require_environment()
        require_extra("dashboards")
    if args.dry_run:
        out = {"entity": args.entity or "<entity>", "project": args.project, "filters": args.filters,
               "dashboard": spec}
        if args.viewspec:
            out["viewspec"] = offline_viewspec(spec, out["entity"], args.project, args.filters)
        json.dump(out, sys.stdout, indent=2)
        print()
        return
    if not args.entity:
        p.error("--entity is required to save the report (or use --dry-run)")
    report = build_report(spec, args.entity, args.project, args.filters).save(draft=args.draft)
    print(report.url)


if __name__ == "__main__":
    main()
