"""``stem-flops``: FLOPs, parameters and training ROI of STEM vs dense SwiGLU transformers from the
command line, and a run's memory plan (``--memory``). Run ``stem-flops --help``; see docs/flops.md and
docs/memory.md."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from stem_megatron.flops.arch import (
    DEFAULT_SEQ_LENGTH,
    REPO,
    FlopsError,
    expand_models,
    list_presets,
    load_arch,
    natural_key,
)
from stem_megatron.flops.params import analytic_parameters, megatron_parameters
from stem_megatron.flops.report import estimate, print_report, print_summary
from stem_megatron.flops.roi import load_results, print_roi, training_roi
from stem_megatron.flops.variants import DENSE, Variant, parse_variant


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stem-flops",
        description="FLOPs, parameters and training ROI of STEM vs dense SwiGLU transformers "
                    "(paper Table 1, §3.1, Table 3). See docs/flops.md.")
    parser.add_argument("models", nargs="*",
                        help="preset names (recipes/flops, recipes/model), globs over them ('qwen2.5_*'), "
                             "or paths to an HF config.json / YAML or a Hugging Face model directory")
    parser.add_argument("-L", "--seq-len", type=int, default=None,
                        help=f"context length L (default: the preset's seq_length, else {DEFAULT_SEQ_LENGTH})")
    parser.add_argument("-B", "--batch", type=int, default=1, help="sequences per batch B (default 1)")
    parser.add_argument("--variant", default="stem",
                        help="dense | stem | stem_dagger | stem_gate | hash_moe, optionally with -RATIO "
                             "(stem-1/2), or a recipes/variant name (stem_full). Default: stem")
    parser.add_argument("--ratio", default=None,
                        help="replaced-layer plan: 1/3 | 1/2 | full (all but layer 0) | all (every layer, "
                             "as §3.1 assumes). Default: from --variant, else 1/3")
    parser.add_argument("--layers", default=None, help="explicit 0-based replaced layers, comma separated")
    parser.add_argument("--num-experts", type=int, default=None, help="hash_moe: experts per replaced layer")
    parser.add_argument("--expert-ffn", type=int, default=None, help="hash_moe: expert d_ff (default d_ff)")
    parser.add_argument("--params", action="store_true",
                        help="also count parameters of the megatron-core model this repo builds "
                             "(starts megatron as a world of one; a few seconds)")
    parser.add_argument("--roi", metavar="RESULTS", default=None,
                        help="training ROI from a results JSON/CSV (name, avg_accuracy, training_tokens, "
                             "preset, variant[, ratio, group, baseline, gflops_per_token, training_flops])")
    parser.add_argument("--baseline", default=None, help="ROI: normalise every row to this row name")
    parser.add_argument("--list", action="store_true", help="list the presets and exit")
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH",
                        help="write one JSON document to PATH (no PATH: print it instead of the text; put it last)")
    memory = parser.add_argument_group(
        "memory plan", "--memory: host bytes per node and device bytes per GPU of a run; the positional arguments are "
                       "stem-train's recipe overrides (+experiment=pretrain_1b variant=stem_1_3 "
                       "host_tables.cache_rows=4096)")
    memory.add_argument("--memory", action="store_true", help="print the memory plan of the run the overrides compose")
    memory.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    memory.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (ranks) per node (default 8); DP = "
                        "nodes x GPUs per node / (TP x PP)")
    memory.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the recipe's)")
    memory.add_argument("--pp", type=int, default=None, help="pipeline stages (default: the recipe's)")
    memory.add_argument("--device", choices=("gpu", "cpu"), default="gpu",
                        help="gpu: bf16 weights, flash attention (default) | cpu: fp32, megatron's local attention")
    memory.add_argument("--here", action="store_true",
                        help="also compare the node that needs most with this machine's shared-memory directory "
                             "and MemAvailable (run it on a node of the cluster)")
    memory.add_argument("--distinct-ids", type=int, default=None,
                        help="distinct token ids per micro-batch (default: those the 128k token profile expects of "
                             "b*s tokens, benchmarks/data; a run's stem_unique_tokens / micro-batches per step gives "
                             "its own); the totals at the bound min(V, b*s) are printed beside")
    memory.add_argument("--step-distinct-ids", type=int, default=None,
                        help="distinct token ids per step of one DP rank, its micro-batches' together (default: the "
                             "profile's when --distinct-ids is not given, else their bound, micro-batches x "
                             "--distinct-ids; ids repeat across micro-batches: 6.5k of 32,768 tokens of the profile)")
    return parser


def _memory(args) -> dict:
    """Compose the run as stem-train would, lay it out, print and return the plan: at the distinct ids given, else
    at those the 128k token profile expects of its batches, with its totals at the ids' bound beside."""
    from stem_megatron.flops.distinct import run_distinct_ids
    from stem_megatron.flops.memory import WITHIN_DENSE, Layout, host_stem_layers, plan, print_plan, working_set_within
    from stem_megatron.host_tables.node import free_space
    from stem_megatron.recipes import compose_run

    try:
        cfg = compose_run(args.models)
    except Exception as e:  # noqa: BLE001 - Hydra's and the schema's messages say what is wrong
        raise FlopsError(f"the overrides {' '.join(args.models)!r} do not compose: {str(e).splitlines()[0]}") from None
    par = cfg.parallel
    par.tensor_model_parallel_size = args.tp or par.tensor_model_parallel_size
    par.pipeline_model_parallel_size = args.pp or par.pipeline_model_parallel_size
    layout = Layout(args.nodes, args.gpus_per_node, par.tensor_model_parallel_size,
                    par.pipeline_model_parallel_size, args.device)
    bound = plan(cfg, layout)  # checks the layout first
    if args.distinct_ids or args.step_distinct_ids:
        ids, source = (args.distinct_ids, args.step_distinct_ids, None), "as given"
    else:
        ids, source = run_distinct_ids(cfg, layout.dp), "expected of the 128k token profile"
    result = plan(cfg, layout, *ids)
    result["overrides"], result["distinct_from"] = list(args.models), source
    result["bound"] = {"distinct_ids": bound["distinct_ids"], "step_distinct_ids": bound["step_distinct_ids"],
                       "device_totals": [s["device_total"] for s in bound["stages"]],
                       "node_totals": [n["total"] for n in bound["nodes"]]}
    if layout.device == "gpu" and any(host_stem_layers(cfg, layout.pp, p) for p in range(layout.pp)):
        result["working_set_within"] = {"ratio": WITHIN_DENSE, "rows": working_set_within(
            cfg, layout, WITHIN_DENSE, *ids[:2])}
    if args.json != "-":
        machine = None
        if args.here:
            shm_dir = cfg.host_tables.shm_dir
            if not os.path.isdir(shm_dir):
                raise FlopsError(f"--here: this machine has no {shm_dir} (host_tables.shm_dir) to hold the tables")
            machine = (shm_dir, *free_space(shm_dir, cfg.host_tables.host_memory_gib))
        print_plan(result, " ".join(args.models) or "the demo (recipes/train.yaml)", machine)
        rows = result.get("working_set_within", {}).get("rows")
        if rows is not None:
            goal = f"within dense's + {WITHIN_DENSE - 1:.0%} on this layout (the GPU step's memory goal)"
            print(f"a working set {goal}: host_tables.resident_rows <= {rows:,} (a set too small for a step's rows "
                  f"grows)" if rows else f"no working set fits {goal} at these distinct ids")
    return result


def _variant_from_args(args) -> Variant:
    """--variant, then --ratio / --layers / --num-experts / --expert-ffn override its fields."""
    variant = parse_variant(args.variant)
    if args.ratio is not None and variant.variant != "dense":
        variant = replace(variant, ratio=args.ratio)
    if args.layers is not None:
        try:
            layers = tuple(int(x) for x in args.layers.split(",") if x.strip())
        except ValueError:
            raise FlopsError(f"--layers {args.layers!r}: expected comma-separated integers") from None
        variant = replace(variant, layers=layers)
    if args.num_experts is not None:
        variant = replace(variant, num_experts=args.num_experts)
    if args.expert_ffn is not None:
        variant = replace(variant, expert_ffn_hidden_size=args.expert_ffn)
    return variant


def run(argv: Sequence[str] | None = None) -> dict:
    """Parse ``argv``, compute, print (text or JSON) and return the JSON-ready result."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.memory:
        result = _memory(args)
        _write_json(result, args.json)
        return result
    if args.list:
        presets = {name: str(path.relative_to(REPO))
                   for name, path in sorted(list_presets().items(), key=lambda kv: natural_key(kv[0]))}
        if args.json:
            _write_json({"presets": presets}, args.json)
        else:
            for name, path in presets.items():
                print(f"{name:<20}{path}")
        return {"presets": presets}
    if not args.models and not args.roi:
        parser.error("give at least one model (preset, glob or config path), --roi RESULTS, or --list")
    if args.seq_len is not None and args.seq_len < 1:
        parser.error("--seq-len must be >= 1")
    if args.batch < 1:
        parser.error("--batch must be >= 1")
    result: dict[str, Any] = {}
    variant = _variant_from_args(args)
    archs = [load_arch(spec) for spec in expand_models(args.models)]
    reports = [estimate(arch, variant, args.seq_len, args.batch) for arch in archs]
    if args.params and archs:
        counted = megatron_parameters([(a, v) for a in archs for v in (DENSE, variant)])
        for i, rep in enumerate(reports):
            dense_c, var_c = counted[2 * i], counted[2 * i + 1]
            rep["parameters"]["megatron"] = {"dense": dense_c, variant.label: var_c}
            # the analytic count of the same architecture (untied, no biases) must agree exactly
            rep["megatron_matches_analytic"] = all(
                {k: analytic_parameters(archs[i], v, tied=False, qkv_bias=False)[k]
                 for k in ("total", "tables", "active")} == {k: c[k] for k in ("total", "tables", "active")}
                for v, c in ((DENSE, dense_c), (variant, var_c)))
    if reports:
        result["models"] = reports
    if args.roi:
        result["roi"] = training_roi(load_results(args.roi), args.baseline, args.seq_len)
    _write_json(result, args.json)
    if args.json != "-":
        for rep in reports:
            print_report(rep)
            if rep.get("megatron_matches_analytic") is False:
                print("   warning: the megatron count differs from the analytic count of the model as built "
                      "(untied, no biases)")
        if len(reports) > 1:
            print_summary(reports)
        if "roi" in result:
            if reports:
                print()
            print_roi(result["roi"])
    return result


def _write_json(result: dict, path: str | None) -> None:
    if path == "-":
        print(json.dumps(result, indent=2))
    elif path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)


def main(argv: Sequence[str] | None = None) -> None:
    """``stem-flops``: bad input is a one-line error and exit status 2, not a traceback."""
    try:
        run(argv)
    except FlopsError as e:
        print(f"stem-flops: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
