"""Memory plan of a run before launch (``stem-flops --memory``): host bytes per node, device bytes per GPU.

Host, per node, as the code lays it out (``host_tables/store.py``, ``node.py``, ``ownership.py``): for every pipeline
stage with ranks on the node and each STEM layer of that stage, the node-shared copy of ``U_l`` (``[tp, V, d_ff/tp]``:
every row on every node, fp32 or bf16 by ``host_tables.read_dtype``, bf16 where it is the master) and the Adam moments
of the rows the node owns (``[tp, owned, cols]`` each, owned = the node's range of ``RowOwnership``, ~V/N over the N
nodes its DP group spans), with bf16 copies of fp32 masters also those master rows: exactly the files
``node.shared_tensors`` creates, in the dtypes and shapes of the run's table state (``table_state.StateSpec``;
``state_bytes.py``, which also gives every setting's bytes a parameter). Per rank: the process (python, torch, megatron,
DeepSpeed's op, gloo, datasets; measured), the row gradients CPU Adam reads, and on GPU the pinned memory the store
reserves before step 1 (``host_tables/transfer.py``, the same functions), block by block as torch pins it (each rounded
up to a power of two, ``pinned_block_bytes``): the staging slots fetched rows pass through (two fetches' rows, in bf16,
and their indices) and one landing buffer per layer for the row gradients the rank updates, both at the ids' bound; with
a working set (``host_tables.resident_rows``) no gradient lands, and its entering and leaving rows' staging and landing
are reserved instead (``working_set_bytes``, at the set's size or the ids' bound), and its rows staged ahead
(``staged_bytes``). The dense model has no host copy.

Device, per GPU (per rank on CPU, where it is host memory too): dense parameters (bf16 on GPU, fp32 on CPU),
their fp32 gradient buffer (``grad_reduce_in_fp32``), megatron's Adam state (fp32 main parameters on GPU and 2
moments; sharded over DP with the distributed optimizer), the hot-row cache, the compact rows of the
micro-batches in flight and the step's merged row gradients (``row_gradients.RowGradients``), and the
activations of the micro-batches 1F1B keeps in flight at their peak (``activations.py``). On CPU with DP > 1 and
the distributed optimizer, gloo's flat staging copy of the DDP buffer its reduce-scatter and all-gather make.

Distinct ids: a micro-batch's (``distinct_ids``), a DP rank's step's (``step_distinct_ids``: its micro-batches'
merged row gradients) and the DP group's step's (``group_distinct_ids``: the rows whose gradients land on the
host) default to their bounds, min(V, b*s), the micro-batches' summed and the group's ranks' summed;
``stem-flops --memory`` passes the 128k token profile's (``distinct.run_distinct_ids``) and prints the bound
beside. Pinned memory is reserved at the bound whatever they are: nothing is pinned mid-step.

``working_set_within`` inverts the plan for the GPU step's memory goal (docs/gpu.md): the most rows a layer a working
set can hold while a GPU's plan stays within a ratio of the dense model's plan on the same layout.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from typing import Optional

from stem_megatron.config import ConfigError, RunConfig, validate_layout
from stem_megatron.flops.activations import FP32, activation_bytes, attention_kept
from stem_megatron.flops.arch import FlopsError
from stem_megatron.flops.layout import Layout, stage_layers
from stem_megatron.flops.state_bytes import (SETTINGS, per_parameter, print_settings, read_dtype, row_bytes,
                                             setting_name)
from stem_megatron.flops.variants import FFN_MATMULS
from stem_megatron.host_tables.ownership import RowOwnership
from stem_megatron.host_tables.transfer import (STAGING_SLOTS, cache_staging_bytes, landing_rows,
                                              pinned_block_bytes, staged_bytes, staged_rows, staging_bytes,
                                              working_set_bytes)
from stem_megatron.layer_plan import planned_layers
from stem_megatron.run_plan import micro_batches_per_step, tables_on_device, tables_on_host
from stem_megatron.table_state import StateSpec

GIB = 2**30
# a rank's peak RSS minus its model, optimizer and activations: python, torch, megatron, DeepSpeed's CPU Adam op,
# gloo, datasets; anonymous memory per rank and the libraries' file pages once per node (two dense models, one
# CPU process, micro-batch 1; docs/memory.md). A CUDA process adds its context and libraries, not counted here.
PROCESS_BYTES, LIBRARY_BYTES = 355 * 2**20, 95 * 2**20
# a working set's device plan at most this times the dense model's: the GPU step's memory goal (docs/gpu.md)
WITHIN_DENSE = 1.10
DEVICE_PARTS = {
    "parameters": "parameters", "gradients": "gradients (fp32)", "optimizer": "Adam state",
    "hot_row_cache": "hot-row cache", "working_set": "working set (rows + Adam state)",
    "step_rows": "STEM rows + step row grads", "activations": "activations (est.)",
    "gloo_staging": "gloo staging of a DDP buffer"}
NODE_PARTS = {
    "tables": "U_l copies (every row)", "masters": "fp32 master rows (owned)",
    "moments": "Adam moments (owned rows)", "process": "processes",
    "adam_gradients": "row gradients for CPU Adam", "pinned_rows": "pinned row staging",
    "device_parts": "ranks' device parts (CPU)"}


def check_layout(cfg: RunConfig, layout: Layout) -> None:
    """FlopsError naming the problem when the run cannot start on ``layout``."""
    n, g, tp, pp = layout.nodes, layout.gpus_per_node, layout.tp, layout.pp
    if min(n, g, tp, pp) < 1:
        raise FlopsError(f"--nodes, --gpus-per-node, --tp and --pp must be >= 1 (got {n}, {g}, {tp}, {pp})")
    if layout.device not in ("gpu", "cpu"):
        raise FlopsError(f"--device {layout.device!r}: expected gpu or cpu")
    if layout.world % (tp * pp):
        raise FlopsError(f"{n} node(s) x {g} GPUs = {layout.world} ranks are not divisible by tp*pp = {tp * pp}")
    if g % tp:
        raise FlopsError(f"TP={tp} does not divide the {g} GPUs of a node: a tensor-parallel group stays in a node")
    stage = tp * layout.dp  # ranks of a pipeline stage
    if stage % g and g % stage:
        raise FlopsError(f"a pipeline stage's {stage} ranks neither fill whole {g}-GPU nodes nor divide a node: "
                         f"its data-parallel groups would spread unevenly over nodes")
    try:
        validate_layout(cfg, layout.world)
    except ConfigError as e:
        raise FlopsError(str(e)) from None


def host_stem_layers(cfg: RunConfig, pp: int, stage: int) -> list[int]:
    """0-based STEM layers of ``stage`` whose ``U_l`` lives in host memory."""
    if not tables_on_host(cfg):
        return []
    return [i for i in planned_layers(cfg.model.num_layers, cfg.stem) if i in stage_layers(cfg, pp, stage)]


def rank_parameters(cfg: RunConfig, layout: Layout, stage: int) -> tuple[int, int]:
    """(parameters, of which Hash-MoE experts) of one rank of ``stage``: megatron's shapes, TP-sharded."""
    m, s, e, tp = cfg.model, cfg.stem, cfg.hash_moe, layout.tp
    d, f, V = m.hidden_size, m.ffn_hidden_size, m.vocab_size
    kv = (m.num_query_groups or m.num_attention_heads) * (d // m.num_attention_heads)
    replaced = set(planned_layers(m.num_layers, s))
    total = experts = 0
    for i in stage_layers(cfg, layout.pp, stage):
        total += (d * (d + 2 * kv) + d * d) // tp + 2 * d  # QKV, projection, two RMSNorms
        if i not in replaced:
            total += 3 * d * f // tp
        elif s.variant == "hash_moe":
            local = e.num_experts // cfg.parallel.expert_model_parallel_size * 3 * d * (e.expert_ffn_hidden_size or f)
            total, experts = total + local, experts + local
        else:
            device_table = V * f // tp if tables_on_device(cfg) else 0
            total += FFN_MATMULS[s.variant] * d * f // tp + device_table
    if stage == 0:
        total += V * d // tp  # embedding
    if stage == layout.pp - 1:
        total += V * d // tp + d  # output layer, final norm
    return total, experts


def _node_stages(layout: Layout, node: int) -> list[tuple[int, int, int, int]]:
    """(stage, index of the node among its DP group's nodes, nodes of a DP group, DP peers on the node) for each
    stage with ranks on ``node`` (TP ranks stay in a node, so they agree)."""
    g, tp, dp = layout.gpus_per_node, layout.tp, layout.dp
    out = {}
    for r in range(node * g, (node + 1) * g):
        stage = r // (tp * dp)
        group = [stage * tp * dp + r % tp + tp * j for j in range(dp)]
        nodes = sorted({q // g for q in group})
        out[stage] = (stage, nodes.index(node), len(nodes), sum(q // g == node for q in group))
    return list(out.values())


def node_shared_bytes(cfg: RunConfig, layout: Layout, node: int, spec: Optional[StateSpec] = None) -> dict[str, int]:
    """Bytes of the node-shared files of ``node`` (``node.shared_tensors``): table copies, and the owned rows' state
    in ``spec``'s dtypes and shapes (default: the run's setting): masters where they are not the copy, moments."""
    spec = spec or StateSpec.of(cfg.host_tables)
    V = cfg.model.vocab_size
    row = row_bytes(spec, read_dtype(cfg.host_tables, spec), cfg.model.ffn_hidden_size, layout.tp)
    out = {"tables": 0, "masters": 0, "moments": 0}
    for stage, dp_node, dp_nodes, peers in _node_stages(layout, node):
        layers = len(host_stem_layers(cfg, layout.pp, stage))
        owned = layers * layout.tp * RowOwnership(V, dp_nodes, dp_node, peers, 0).owned_rows
        out["tables"] += layers * layout.tp * V * row["copy"]
        out["moments"] += owned * (row["exp_avg"] + row["exp_avg_sq"])
        out["masters"] += owned * row["master"]
    return out


def table_settings(cfg: RunConfig, layout: Layout) -> list[dict]:
    """Each table-state setting's bytes per parameter (``state_bytes.per_parameter``) and the neediest node's table
    files (``node_bytes``), so a user sees what another setting would save."""
    h, d_ff = cfg.host_tables, cfg.model.ffn_hidden_size
    return [{"setting": setting_name(spec), **per_parameter(spec, read_dtype(h, spec), d_ff, layout.tp),
             "node_bytes": max(sum(node_shared_bytes(cfg, layout, n, spec).values()) for n in range(layout.nodes))}
            for spec in SETTINGS]


def pinned_bytes(cfg: RunConfig, layout: Layout, stage: tuple[int, int, int, int], layers: int, itemsize: int) -> int:
    """The pinned bytes the ranks of a stage on a node reserve before step 1 (``host_tables/transfer.py``, the same
    functions; ``stage``: an entry of ``_node_stages``, ``layers`` its STEM layers, ``itemsize`` a row's as it
    travels), at the ids' bound, each block as torch pins it: a rank's staging slots, and its landing buffers (one
    a layer) or its working set's slots, landing buffers (one a layer and kind of state) and rows staged ahead."""
    m, h, t = cfg.model, cfg.host_tables, cfg.train
    V, cols, tokens = m.vocab_size, m.ffn_hidden_size // layout.tp, t.micro_batch_size * m.seq_length
    _, dp_node, dp_nodes, peers = stage
    slot = max(staging_bytes(layers, min(V, tokens), cols, itemsize, tokens),
               cache_staging_bytes(min(h.cache_rows, V), cols, itemsize))
    micro = micro_batches_per_step(cfg, layout.dp)
    step_ids = layout.dp * min(V, micro * tokens)  # as the store bounds them (``store.py``)
    total = 0
    for peer in range(peers):
        rows = landing_rows(RowOwnership(V, dp_nodes, dp_node, peers, peer), step_ids)
        if h.resident_rows:  # gradients stay on the device; the working set's rows move through its own
            moving = min(h.resident_rows, rows)
            staged, kept = working_set_bytes(moving, cols, tokens)
            own = [staged] * STAGING_SLOTS + [kept] * (3 * layers) + [
                staged_bytes(staged_rows(moving, layers), layers, cols)]
        else:
            own = [rows * cols * FP32] * layers
        total += layout.tp * sum(map(pinned_block_bytes, [slot] * STAGING_SLOTS + own))
    return total


def plan(cfg: RunConfig, layout: Layout, distinct_ids: Optional[int] = None,
         step_distinct_ids: Optional[int] = None, group_distinct_ids: Optional[int] = None) -> dict:
    """The plan as a JSON-ready dict: ``stages`` (one rank's device parts), ``nodes`` (host parts per node).
    ``distinct_ids``: a micro-batch's, ``step_distinct_ids``: a step's (one DP rank's), ``group_distinct_ids``: a
    step's of the DP group; default: their bounds."""
    check_layout(cfg, layout)
    m, h, t, par = cfg.model, cfg.host_tables, cfg.train, cfg.parallel
    V, gpu, dp, row = m.vocab_size, layout.device == "gpu", layout.dp, m.ffn_hidden_size // layout.tp * FP32
    micro = micro_batches_per_step(cfg, dp)
    uniq = min(V, distinct_ids or t.micro_batch_size * m.seq_length)
    step_uniq = min(V, micro * uniq, step_distinct_ids or V)  # distinct ids of a step (one DP rank's micro-batches)
    spec = StateSpec.of(h)
    copy_row = row // (2 if read_dtype(h, spec) == "bf16" else 1)  # a row of the host copies
    travel_row = min(copy_row, row // 2) if gpu else copy_row  # a row as it travels (bf16 on GPU): staging, cache
    stages = []
    for p in range(layout.pp):
        params, experts = rank_parameters(cfg, layout, p)
        state = (FP32 if gpu else 0) + 2 * FP32  # fp32 main copy of bf16 weights, two Adam moments
        expert_dp = dp * layout.tp // par.expert_model_parallel_size
        sharded = (params - experts) / dp + experts / expert_dp if par.use_distributed_optimizer else params
        layers = len(host_stem_layers(cfg, layout.pp, p))
        in_flight = min(micro, layout.pp - p)  # micro-batches 1F1B holds between forward and backward
        device = {
            "parameters": params * (2 if gpu else FP32),
            "gradients": params * FP32,
            "optimizer": int(state * sharded),
            "hot_row_cache": layers * min(h.cache_rows, V) * travel_row,
            # fp32 master, exp_avg, exp_avg_sq a slot; at DP > 1 the step's rows received from their owners
            # (step_rows.StepRows)
            "working_set": layers * min(h.resident_rows, V) * 3 * row
            + layers * step_uniq * travel_row * (dp > 1 and h.resident_rows > 0),
            # the step's merged row gradients (one buffer a layer over its distinct ids), the fp32 rows of the
            # micro-batches in flight and queued by the prefetcher (a working set's queue holds slots, not rows),
            # one micro-batch's gradient being merged and one layer's exchange (row_gradients.RowGradients)
            "step_rows": (layers * step_uniq + min(micro, in_flight + h.prefetch_depth * (not h.resident_rows))
                          * layers * uniq + bool(layers) * (uniq + 2 * step_uniq)) * row,
            "activations": activation_bytes(cfg, layout, p, in_flight, uniq),
            # CPU: gloo's reduce-scatter of the grad buffer and all-gather of the param buffer (distributed
            # optimizer, DP > 1; one bucket) stage a flat copy of the whole buffer; skipped at DP = 1 (cpu_compat)
            "gloo_staging": params * FP32 * (not gpu and dp > 1 and par.use_distributed_optimizer),
        }
        stages.append({"stage": p, "stem_layers": [i + 1 for i in host_stem_layers(cfg, layout.pp, p)],
                       "parameters": params, "device": device, "device_total": sum(device.values())})
    nodes = []
    for n in range(layout.nodes):
        ranks = dict.fromkeys(("process", "adam_gradients", "pinned_rows", "device_parts"), 0)
        for stage, dp_node, dp_nodes, peers in _node_stages(layout, n):
            layers, count = len(stages[stage]["stem_layers"]), peers * layout.tp  # the stage's ranks here
            mine = math.ceil(V / (dp_nodes * peers))  # rows one rank updates: its share of its node's
            touched = min(mine, math.ceil((group_distinct_ids or dp * step_uniq) / (dp_nodes * peers)))
            grads = layers * touched * (row + 8)  # dense Adam adds no zero gradients (row_adam: grads None)
            ranks["process"] += count * PROCESS_BYTES
            ranks["adam_gradients"] += count * grads
            if gpu and layers:
                ranks["pinned_rows"] += pinned_bytes(cfg, layout, (stage, dp_node, dp_nodes, peers), layers,
                                                     travel_row * FP32 // row)
            ranks["device_parts"] += count * stages[stage]["device_total"] * (not gpu)
        ranks["process"] += LIBRARY_BYTES
        shared = node_shared_bytes(cfg, layout, n)
        nodes.append({"node": n, "stages": [e[0] for e in _node_stages(layout, n)], "shared": shared,
                      "ranks": ranks, "total": sum(shared.values()) + sum(ranks.values())})
    settings = table_settings(cfg, layout) if any(stage["stem_layers"] for stage in stages) else []
    return {"layout": asdict(layout) | {"dp": dp}, "micro_batches": micro, "distinct_ids": uniq,
            "step_distinct_ids": step_uniq, "attention": attention_kept(cfg, layout)[0],
            "optimizer": h.optimizer, "distributed_optimizer": par.use_distributed_optimizer, "stages": stages,
            "nodes": nodes,
            "table_state": {"setting": setting_name(spec), "read_dtype": h.read_dtype, "settings": settings}}


def working_set_within(cfg: RunConfig, layout: Layout, ratio: float, distinct_ids: Optional[int] = None,
                       step_distinct_ids: Optional[int] = None) -> int:
    """The most rows a layer ``host_tables.resident_rows`` can hold while every stage's device plan stays within
    ``ratio`` times the dense model's on ``layout`` (the same micro-batches), at most V; 0 where not even one row
    fits. The plan grows by the same bytes with each row (its master and moments in every STEM layer of the stage),
    read off the plans of sets of one and two rows. A set smaller than a step's distinct ids grows in the run
    (``working_set.py``)."""
    def stages(resident_rows: int, variant: str = cfg.stem.variant) -> list[int]:
        run = replace(cfg, stem=replace(cfg.stem, variant=variant),
                      host_tables=replace(cfg.host_tables, resident_rows=resident_rows))
        return [stage["device_total"] for stage in plan(run, layout, distinct_ids, step_distinct_ids)["stages"]]

    rows = cfg.model.vocab_size
    for dense, one, two in zip(stages(0, variant="dense"), stages(1), stages(2)):
        per_row = two - one
        if per_row:  # a stage with STEM layers
            rows = min(rows, max(0, math.floor((ratio * dense - (one - per_row)) / per_row)))
    return rows


def print_plan(result: dict, title: str, machine: Optional[tuple[str, int, int]] = None) -> None:
    """The plan as two tables (per GPU by stage, per node by kind of node), each ending with its totals at the ids'
    bound where ``result["bound"]`` holds them; ``machine``: (shared-memory directory, its free bytes,
    MemAvailable) of this machine, compared with the node that needs most."""
    lay, bound = result["layout"], result.get("bound")
    unit = "GPU" if lay["device"] == "gpu" else "rank"
    print(f"memory plan: {title}")
    print(f"  {lay['nodes']} node(s) x {lay['gpus_per_node']} {unit}s, TP={lay['tp']} PP={lay['pp']} DP={lay['dp']}, "
          f"{'bf16 on GPU' if lay['device'] == 'gpu' else 'fp32 on CPU'}, "
          f"{'distributed' if result['distributed_optimizer'] else 'replicated'} Adam; {result['micro_batches']} "
          f"micro-batch(es) a step; STEM Adam {result['optimizer']}, table state {result['table_state']['setting']}")
    print(f"  distinct ids: {result['distinct_ids']:,} a micro-batch, {result['step_distinct_ids']:,} a step"
          + (f", {result['distinct_from']} (bound: {bound['distinct_ids']:,}, {bound['step_distinct_ids']:,})"
             if bound else ""))
    print(f"  attention: {result['attention']}")
    stages = result["stages"]
    _table(f"per {unit}", [f"stage {s['stage']}" for s in stages], DEVICE_PARTS,
           [s["device"] for s in stages], [s["device_total"] for s in stages], bound and bound["device_totals"])
    groups: dict = {}
    for node in result["nodes"]:
        groups.setdefault(repr((node["stages"], node["shared"], node["ranks"])), []).append(node)
    names = [f"node {g[0]['node']}" + (f"-{g[-1]['node']}" if len(g) > 1 else "") for g in groups.values()]
    _table("per node", names, NODE_PARTS, [g[0]["shared"] | g[0]["ranks"] for g in groups.values()],
           [g[0]["total"] for g in groups.values()],
           bound and [bound["node_totals"][g[0]["node"]] for g in groups.values()])
    state = result["table_state"]
    if state["settings"]:
        print_settings(state["settings"], state["setting"], state["read_dtype"], (GIB, "GiB"))
    if lay["device"] == "gpu":
        print("processes: measured on CPU; a CUDA process's context and libraries come on top. Activations: counted "
              "from what the modules keep, measured on CPU (docs/memory.md)"
              + ("" if lay["transformer_engine"] else "; without Transformer Engine"))
    if machine:
        directory, free, available = machine
        most, shared, fits = neediest_node(result, free, available)
        print(f"this machine: {directory} {free / GIB:.2f} GiB free, MemAvailable {available / GIB:.2f} GiB; node "
              f"{most['node']} needs {shared / GIB:.2f} GiB shared, {most['total'] / GIB:.2f} GiB in all: "
              f"{'fits' if fits else 'does NOT fit'}")


def neediest_node(result: dict, free: int = 0, available: int = 0) -> tuple[dict, int, bool]:
    """The plan's node that needs most, its shared bytes, and whether ``free`` shared-memory bytes and ``available``
    memory hold it."""
    most = max(result["nodes"], key=lambda n: n["total"])
    shared = sum(most["shared"].values())
    return most, shared, shared <= free and most["total"] <= available


def _table(head: str, columns: list[str], parts: dict, values: list[dict], totals: list[int],
           bound: Optional[list[int]] = None) -> None:
    size, unit = (GIB, "GiB") if max(totals + (bound or [])) >= GIB else (2**20, "MiB")
    print(f"\n{head:<32}" + "".join(f"{c:>14}" for c in columns))
    for key, label in parts.items():
        if any(v[key] for v in values):
            print(f"  {label:<30}" + "".join(f"{v[key] / size:>10.2f} {unit}" for v in values))
    for label, row in (("total", totals), ("total at the ids' bound", bound)):
        if row:
            print(f"  {label:<30}" + "".join(f"{t / size:>10.2f} {unit}" for t in row))
