"""The memory plan (``stem-flops --memory``, ``flops/memory.py``): its host bytes are the bytes the store maps on
each node (four ranks emulating 2 and 4 nodes, as tests/test_row_ownership.py does), its parameter counts are
those of the megatron model each rank builds, its activations what a real forward and backward keep and peak at,
its pinned memory the blocks torch pins, its table files each table-state setting's bytes; the CLI prints it for a
recipe at the profile's distinct ids with the bound beside, and a bad layout is a clear error."""

import dataclasses
import importlib.util
import json
import os
import re
from pathlib import Path

import distributed
import pytest
import torch

from stem_megatron.config import (
    DataConfig,
    HostTablesConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    STEMConfig,
    TrainConfig,
)
from stem_megatron.flops.cli import main
from stem_megatron.flops.memory import GIB, Layout, node_shared_bytes, plan, rank_parameters

V = 1002  # not a multiple of the node counts: owner ranges differ by a row


def _config(tp: int, pp: int, **host_tables) -> RunConfig:
    return RunConfig(model=ModelConfig(num_layers=4, hidden_size=16, ffn_hidden_size=24, num_attention_heads=2,
                                       vocab_size=V, seq_length=8),
                     stem=STEMConfig(ratio="1/2"), host_tables=HostTablesConfig(**host_tables),
                     parallel=ParallelConfig(tp, pp),
                     train=TrainConfig(micro_batch_size=1, global_batch_size=4), data=DataConfig(vocab_size=V))


def _store_and_model(nodes: int, tp: int, pp: int, copies: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from stem_megatron.host_tables.placement import build_tables
    from stem_megatron.model.device_table import DeviceRowTable
    from stem_megatron.model.gpt import build_gpt, transformer_config
    from stem_megatron.run_plan import micro_batches_per_step

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ["GROUP_RANK"] = str(rank * nodes // world)  # the launcher's node: ranks node by node
    cfg = _config(tp, pp, read_dtype=copies)
    tconfig = transformer_config(cfg.model, cfg.parallel, on_gpu=False, stem=cfg.stem)
    store = build_tables(cfg, tconfig, torch.device("cpu"),
                         micro_batches_per_step(cfg, parallel_state.get_data_parallel_world_size()))
    with torch.device("meta"):  # the tables as device parameters: what build_gpt makes without a row source
        gpt = build_gpt(cfg.model, cfg.stem, transformer_config(cfg.model, cfg.parallel, on_gpu=False, stem=cfg.stem))
    total = sum(p.numel() for p in gpt.parameters())
    tables = sum(m.weight.numel() for m in gpt.modules() if isinstance(m, DeviceRowTable))
    counted = {"device": total, "host": total - tables}  # host tables: the layer holds no parameter
    return {"node": store.own.node, "host_bytes": store.host_bytes, "parameters": counted,
            "stage": parallel_state.get_pipeline_model_parallel_rank()}


@pytest.mark.slow
@pytest.mark.parametrize("nodes,tp,pp,copies", [(4, 1, 1, "fp32"), (2, 2, 1, "fp32"), (2, 1, 2, "fp32"),
                                               (4, 1, 1, "bf16")])
def test_plan_is_what_each_node_maps_and_each_rank_builds(nodes, tp, pp, copies):
    """4 ranks: 4 nodes of 1 (DP over 4 nodes), 2 nodes of a TP pair (DP over 2), 2 nodes of one stage each;
    and 4 nodes with bf16 copies of the tables (fp32 masters of the owned rows)."""
    layout = Layout(nodes, 4 // nodes, tp, pp, "cpu")
    for r in distributed.run(_store_and_model, 4, nodes, tp, pp, copies, tp=tp, pp=pp):
        cfg = _config(tp, pp, read_dtype=copies)
        assert r["host_bytes"] == sum(node_shared_bytes(cfg, layout, r["node"]).values()) > 0
        for placement, count in r["parameters"].items():
            assert rank_parameters(_config(tp, pp, placement=placement), layout, r["stage"])[0] == count, placement
    planned = plan(_config(tp, pp, read_dtype=copies), layout)
    assert [sum(n["shared"].values()) for n in planned["nodes"]] == [
        sum(node_shared_bytes(_config(tp, pp, read_dtype=copies), layout, n).values()) for n in range(nodes)]


def test_one_node_holds_every_row_and_its_moments():
    cfg = _config(1, 1)
    row = 24 * 4
    assert node_shared_bytes(cfg, Layout(1, 2), 0) == {"tables": 2 * V * row, "masters": 0, "moments": 2 * 2 * V * row}
    # 3 nodes: each holds every row, and moments for its third (334 rows)
    assert node_shared_bytes(cfg, Layout(3, 1), 1) == {"tables": 2 * V * row, "masters": 0,
                                                       "moments": 2 * 2 * 334 * row}


LEAN = dict(state_dtype="bf16", second_moment="row", master_dtype="bf16", read_dtype="bf16")


@pytest.mark.parametrize("setting,name,copy,state", [
    ({}, "fp32", 0, 4 + 4 + 4),  # the fp32 copy is the master, two fp32 moments
    ({"read_dtype": "bf16"}, "fp32", 2, 4 + 4 + 4),  # fp32 masters beside the bf16 copy, which each update writes
    (LEAN, "lean", 0, 2 + 2),  # the bf16 copy is the master, a bf16 exp_avg, and 8 fp32 exp_avg_sq a row
], ids=["fp32", "fp32-bf16-copies", "lean"])
def test_the_plans_host_bytes_a_table_parameter_are_the_settings_and_scale_with_the_tables(setting, name, copy,
                                                                                            state):
    """One node owns every row: its table files are the setting's bytes a parameter x V x d_ff x STEM layers at any
    shape, and an update moves the state twice (read and written), the fp32 gradient where the row has one, and
    the copy it writes."""
    for layers, stem_layers, d_ff, vocab in ((4, 2, 24, V), (6, 3, 24, V), (4, 2, 48, V), (4, 2, 24, 2 * V)):
        cfg = RunConfig(model=ModelConfig(num_layers=layers, hidden_size=16, ffn_hidden_size=d_ff,
                                          num_attention_heads=2, vocab_size=vocab, seq_length=8),
                        stem=STEMConfig(ratio="1/2"), host_tables=HostTablesConfig(**setting),
                        train=TrainConfig(micro_batch_size=1, global_batch_size=1), data=DataConfig(vocab_size=vocab))
        planned = plan(cfg, Layout(1, 1, device="cpu"))
        host = copy + state + (8 * 4 / d_ff if setting.get("second_moment") == "row" else 0)
        state_bytes = {row["setting"]: row for row in planned["table_state"]["settings"]}
        assert planned["table_state"]["setting"] == name
        ours = state_bytes[name]
        assert (ours["host"], ours["touched"], ours["untouched"]) == pytest.approx(
            (host, 2 * (host - copy) + copy + 4, 2 * (host - copy) + copy), rel=1e-12)
        shared = sum(planned["nodes"][0]["shared"].values())
        assert shared == ours["node_bytes"] == pytest.approx(host * vocab * d_ff * stem_layers, rel=1e-12)
        # what lean would save, beside every setting's plan
        assert state_bytes["lean"]["node_bytes"] == pytest.approx((4 + 8 * 4 / d_ff) * vocab * d_ff * stem_layers)


def test_cli_prints_the_plan_of_a_recipe(tmp_path, capsys):
    path = tmp_path / "plan.json"
    main(["--memory", "+experiment=pretrain_350m", "variant=stem_1_3", "--nodes", "2", "--json", str(path)])
    out = capsys.readouterr().out
    assert "memory plan: +experiment=pretrain_350m variant=stem_1_3" in out
    assert "2 node(s) x 8 GPUs, TP=1 PP=1 DP=16" in out and "per GPU" in out and "per node" in out
    assert "U_l copies" in out and "Adam moments" in out and "activations (est.)" in out
    # every table-state setting's bytes a parameter (host, moved with and without a gradient), the run's marked
    assert re.search(r"\n  fp32 \(this run\) +12\.000 +28\.000 +24\.000 .*\n(.*\n)*  lean +4\.013 +12\.025 +8\.025 ",
                     out)
    assert "this machine" not in out  # an 8-node plan is not judged against the machine it is typed on
    result = json.loads(path.read_text())
    shared = result["nodes"][0]["shared"]
    assert shared["tables"] == 10 * 32000 * 2560 * 4 and shared["moments"] == 2 * 10 * 16000 * 2560 * 4
    # the profile's distinct ids of 8 x 2048 tokens (the default), their bound beside
    assert result["micro_batches"] == 4 and result["distinct_ids"] == 4400
    assert result["bound"]["distinct_ids"] == 8 * 2048


def test_here_compares_the_plan_with_this_machine(capsys):
    """The demo's plan (tens of MiB) on this machine: /dev/shm's free space and MemAvailable named, and it fits."""
    main(["--memory", "parallel=single", "--gpus-per-node", "1", "--device", "cpu", "--here"])
    line = capsys.readouterr().out.splitlines()[-1]
    assert re.fullmatch(r"this machine: /dev/shm [\d.]+ GiB free, MemAvailable [\d.]+ GiB; node 0 needs [\d.]+ GiB "
                        r"shared, [\d.]+ GiB in all: fits", line), line


@pytest.mark.parametrize("args,message", [
    (["--nodes", "2", "--gpus-per-node", "6", "--tp", "4"], "TP=4 does not divide the 6 GPUs of a node"),
    (["--gpus-per-node", "3", "--pp", "2"], "3 ranks are not divisible by tp*pp = 2"),
    (["--gpus-per-node", "8", "--pp", "3"], "not divisible by tp*pp = 3"),
    (["--nodes", "3", "--pp", "2"], "neither fill whole 8-GPU nodes nor divide a node"),
    (["--nodes", "0"], "must be >= 1"),
    (["--gpus-per-node", "3"], "train.global_batch_size: 512 is not divisible by micro_batch_size*dp = 24"),
    (["model.num_layers=five"], "do not compose"),
])
def test_a_bad_layout_is_a_clear_error(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--memory", "+experiment=pretrain_350m", *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("stem-flops: error: ") and message in err, err


def _attention_config(mask: bool, groups=None) -> RunConfig:
    return RunConfig(model=ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8,
                                       num_query_groups=groups, vocab_size=V, seq_length=256),
                     stem=STEMConfig(ratio="1/2"), data=DataConfig(vocab_size=V, reset_attention_mask=mask))


@pytest.mark.parametrize("device,te,mask,probabilities,additive_mask", [
    ("cpu", True, False, 0, 0), ("cpu", True, True, 0, 4),  # CPU flash, with a mask too (fp32, per layer)
    ("gpu", True, False, 0, 0), ("gpu", True, True, 2, 0),  # TE fused; an arbitrary mask: TE's unfused s x s
    ("gpu", False, False, 0, 0), ("gpu", False, True, 0, 2),  # SDPA flash; memory-efficient with a bf16 bias
])
def test_attention_keeps_no_s_by_s_probabilities_but_on_te_unfused(device, te, mask, probabilities, additive_mask):
    """What each attention path keeps per token and layer (``attention_kept``): q, k, v (the QKV output while v is a
    view of it), the output, a logsumexp per head, and only TE's unfused attention the s x s probabilities."""
    from stem_megatron.flops.memory import attention_kept

    d, heads, s = 64, 8, 256
    layout = Layout(1, 1, device=device, transformer_engine=te)
    for groups, kv in ((None, d), (2, 16)):
        path, kept = attention_kept(_attention_config(mask, groups), layout)
        w = 2 if device == "gpu" else 4
        repeated = kv < d and (device == "cpu" or mask)  # K/V repeated to every head, QKV output freed
        elements = 3 * d if repeated else 2 * d + 3 * kv  # q, k, v
        elements += d * (1 + (device == "gpu" and not te and mask))  # output (and its batch-first copy)
        per_head = s * probabilities if probabilities else 4  # s x s probabilities or an fp32 logsumexp
        assert kept == elements * w + heads * per_head + additive_mask * s, (path, groups)
    assert ("unfused" in path) == bool(probabilities)



def test_activations_of_a_token_count_do_not_grow_with_the_sequence():
    """Without a mask no path keeps anything s x s: the same tokens as 1 x 512 or 2 x 256 plan the same bytes."""
    from stem_megatron.flops.memory import activation_bytes

    def planned(batch, seq, device):
        cfg = _attention_config(False)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, seq_length=seq),
                                  train=TrainConfig(micro_batch_size=batch, global_batch_size=batch))
        return activation_bytes(cfg, Layout(1, 1, device=device), 0, 1)

    for device in ("cpu", "gpu"):
        assert planned(1, 512, device) == planned(2, 256, device) > 0


def _resident_plan(rows: int, **distinct) -> tuple[RunConfig, dict]:
    """(the config, its plan's stage) of 1B STEM-1/3 on one GPU at gpu_step's batch (16 x 2048 tokens, micro-batch
    2), lazy Adam, a set of ``rows``."""
    from stem_megatron.recipes import compose_run

    cfg = compose_run(["+experiment=pretrain_1b", "model.seq_length=2048", "train.global_batch_size=16",
                       "train.micro_batch_size=2", "variant=stem_1_3", "host_tables.optimizer=lazy",
                       f"host_tables.resident_rows={rows}"])
    return cfg, plan(cfg, Layout(1, 1), **distinct)["stages"][0]


def test_a_steps_distinct_ids_and_a_working_sets_queue_of_slots_lower_the_planned_rows():
    """A step's merged row gradients are planned over its distinct ids (ids repeat across micro-batches: 6,528 of
    32,768 profile tokens, where 8 micro-batches of 1,777 bound them at 14,216); with a working set the prefetcher
    queues slots, not rows, so only the micro-batch in flight holds rows."""
    layers, row, u, s = 5, 8192 * 4, 1777, 6528
    _, bound = _resident_plan(0, distinct_ids=u)
    _, host = _resident_plan(0, distinct_ids=u, step_distinct_ids=s)
    _, resident = _resident_plan(16384, distinct_ids=u, step_distinct_ids=s)
    assert bound["device"]["step_rows"] - host["device"]["step_rows"] == (layers + 2) * (8 * u - s) * row
    assert host["device"]["step_rows"] - resident["device"]["step_rows"] == 2 * layers * u * row  # prefetch_depth 2
    assert resident["device"]["working_set"] == layers * 16384 * 3 * row
    # more distinct ids than its micro-batches hold is their bound
    assert _resident_plan(0, distinct_ids=u, step_distinct_ids=10**6)[1]["device"] == bound["device"]


@pytest.mark.parametrize("ratio", [1.10, 1.25])
def test_the_working_set_within_a_ratio_of_dense_is_the_largest_whose_plan_stays_there(ratio):
    from stem_megatron.flops.memory import working_set_within

    distinct = dict(distinct_ids=1777, step_distinct_ids=6528)
    cfg, _ = _resident_plan(0)
    dense = plan(dataclasses.replace(cfg, stem=dataclasses.replace(cfg.stem, variant="dense")), Layout(1, 1),
                 **distinct)["stages"][0]["device_total"]
    rows = working_set_within(cfg, Layout(1, 1), ratio, **distinct)
    assert 6528 < rows < 128256  # more than a step's rows, fewer than the table's
    assert _resident_plan(rows, **distinct)[1]["device_total"] <= ratio * dense
    assert _resident_plan(rows + 1, **distinct)[1]["device_total"] > ratio * dense
    assert working_set_within(cfg, Layout(1, 1), 0.95, **distinct) == 0  # not even a row: 0, never negative


def test_cli_says_the_largest_working_set_within_the_goal(capsys):
    """The recipe's layout (8 GPUs, DP = 8) at the profile's distinct ids of a rank's micro-batch and step."""
    args = ["--memory", "+experiment=pretrain_1b", "variant=stem_1_3"]
    main([*args, "--distinct-ids", "4408", "--step-distinct-ids", "16018"])
    assert re.search(r"a working set within dense's \+ 10% on this layout \(the GPU step's memory goal\): "
                     r"host_tables.resident_rows <= \d[\d,]+ \(a set too small for a step's rows grows\)\n$",
                     capsys.readouterr().out)
    main([*args, "--distinct-ids", "16384", "--step-distinct-ids", "128256"])  # at the ids' bound (every token a
    # distinct id) the step's rows alone exceed it
    assert capsys.readouterr().out.splitlines()[-1].startswith("no working set fits within dense's + 10%")


@pytest.mark.parametrize("experiment,ids", [("pretrain_1b", (4408, 16018)), ("pretrain_350m", (4400, 12360))])
def test_a_recipe_fits_an_h100_by_its_plan_at_the_profiles_ids_with_the_bound_beside(experiment, ids, tmp_path,
                                                                                     capsys):
    """The paper's recipes on the 8 GPUs they name: at the distinct ids the 128k token profile expects of
    a micro-batch's and a DP rank's step's tokens, STEM-1/3's plan per GPU stays within 70 GiB; the totals at the
    ids' bound are the tables' last lines."""
    path = tmp_path / "plan.json"
    main(["--memory", f"+experiment={experiment}", "variant=stem_1_3", "--json", str(path)])
    out, result = capsys.readouterr().out, json.loads(path.read_text())
    total, bound = result["stages"][0]["device_total"], result["bound"]
    assert (result["distinct_ids"], result["step_distinct_ids"]) == ids
    assert f"distinct ids: {ids[0]:,} a micro-batch, {ids[1]:,} a step, expected of the 128k token profile" in out
    assert total <= 70 * GIB < 80e9 and total < bound["device_totals"][0]
    totals = re.findall(r"\n  total at the ids' bound +([\d.]+) GiB", out)
    assert totals == [f"{bound['device_totals'][0] / GIB:.2f}", f"{bound['node_totals'][0] / GIB:.2f}"]


def test_distinct_ids_are_what_draws_from_the_profile_hold():
    """The curve the plan reads (``distinct.expected_distinct_ids``) against ids drawn from the profile: within 2%
    at a micro-batch's and a step's tokens, at the full vocabulary and at 350M's 32,000 (its most frequent ids)."""
    import numpy as np

    from stem_megatron.flops.distinct import expected_distinct_ids, profile_counts, profile_ids

    rng = np.random.default_rng(0)
    for vocab in (128256, 32000):
        ids, p = profile_ids(profile_counts(), vocab)
        expected = expected_distinct_ids(profile_counts(), vocab, (16384, 262144))
        drawn = [len(np.unique(rng.choice(ids, size=n, p=p))) for n in (16384, 262144)]
        assert expected == pytest.approx(drawn, rel=0.02) and drawn[0] < drawn[1] < vocab


def test_pinned_blocks_are_planned_as_torch_pins_them():
    """torch's CachingHostAllocator rounds each pinned block up to a power of two; the plan counts blocks: 350M
    STEM-1/3 on one GPU, two staging slots of 0.78 GiB and ten landing buffers of 32,000 rows (327.7 MB)
    pin 2 x 1 GiB and 10 x 512 MiB; 1B with a working set of 16,384 rows at gpu_step's batch, 14.5 GiB (15.6 GB,
    the issue's) where the bytes asked are 12.63 GiB."""
    from stem_megatron.host_tables.transfer import pinned_block_bytes
    from stem_megatron.recipes import compose_run

    assert [pinned_block_bytes(n) for n in (0, 1, 4096, 4097, 327_680_000)] == [0, 1, 4096, 8192, 2**29]
    cfg = compose_run(["+experiment=pretrain_350m", "variant=stem_1_3"])
    assert plan(cfg, Layout(1, 1))["nodes"][0]["ranks"]["pinned_rows"] == 2 * 2**30 + 10 * 2**29
    resident, _ = _resident_plan(16384)
    assert plan(resident, Layout(1, 1))["nodes"][0]["ranks"]["pinned_rows"] == 14.5 * 2**30


MEASURED = [  # the demo's tiny model (MHA) and a wider one (d_ff = 4d, K/V in 2 groups), each variant's FFN path
    ["model=tiny", "variant=dense"],
    ["model=tiny", "variant=stem_1_2"],  # host tables: stem_rows' product over compact rows
    ["model=tiny", "variant=stem_1_2", "host_tables.placement=device"],
    ["model=tiny", "variant=stem_dagger", "stem.ratio=1/2"],  # host rows gathered to tokens
    ["model.hidden_size=256", "model.ffn_hidden_size=1024", "model.num_attention_heads=8", "model.num_query_groups=2",
     "model.vocab_size=8192", "model.seq_length=256", "train.micro_batch_size=2", "variant=stem_1_3"],
    ["model=tiny", "variant=stem_1_2", "data.reset_attention_mask=true"],  # the per-document mask
]


def _measure(runs: list[list[str]]) -> list[dict]:
    from stem_megatron.recipes import compose_run

    spec = importlib.util.spec_from_file_location("memory_plan", Path(__file__).parents[1] / "benchmarks" /
                                                  "memory_plan.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return [bench.measure_activations(compose_run(["parallel=single", *run])) for run in runs]


@pytest.mark.slow
def test_the_planned_activations_are_what_a_real_forward_and_backward_keep_and_peak_at():
    """One micro-batch of each run on CPU (``benchmarks/memory_plan.py --activations``): the bytes autograd keeps
    for backward are the plan's count, and the peak of torch's allocations (the fetched rows' leaves aside) its count
    plus the one transient, each within 2% (measured 0.4-0.8%; counting 4 tensors of d_ff for a
    host STEM layer would be 10% over the kept bytes of these host STEM runs)."""
    from stem_megatron.flops.activations import kept_bytes, transient_bytes
    from stem_megatron.recipes import compose_run

    layout = Layout(1, 1, device="cpu")
    for run, measured in zip(MEASURED, distributed.run(_measure, 1, MEASURED)[0], strict=True):
        cfg = compose_run(["parallel=single", *run])
        kept = kept_bytes(cfg, layout, 0, measured["distinct_ids"])
        assert kept == pytest.approx(measured["kept"], rel=0.02), run
        peak = measured["peak"] - measured["rows"]  # the fetched rows' leaves are the plan's step rows
        assert kept + transient_bytes(cfg, layout, 0) == pytest.approx(peak, rel=0.02), run
