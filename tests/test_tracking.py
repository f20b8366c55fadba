"""W&B tracking offline (written, then read back with wandb's own reader; a requeued job continuing the run), FLOPs/MFU,
the dashboard spec and the plot tool.

The W&B run is offline and every W&B address points at a closed local port, so nothing can leave the
machine; the run is read back with ``wandb leet inspect --json`` (wandb-core's reader of the
``run-*.wandb`` transaction log).
"""

import dataclasses
import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch

from stem_megatron.config import HashMoEConfig, ModelConfig, RunConfig, STEMConfig
from stem_megatron.flops.mfu import device_peak_tflops, model_flops_per_token, throughput_metrics
from stem_megatron.training.spikes import SpikeDetector
from stem_megatron.training.wandb_run import WandbTracker, inspect_offline_run

REPO = Path(__file__).resolve().parents[1]
SPIKE_STEPS = (30, 45)
NAN_STEP = 52
STEPS = 60
EXPERTS = [5, 9, 3, 7]


def _load_tool(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _records():
    """Step records as the loop builds them, with the detector's fields merged in."""
    det = SpikeDetector(window=20, warmup=10)
    out = []
    for step in range(1, STEPS + 1):
        loss = 4.0 - 0.01 * step + 0.003 * math.sin(step * 1.7)
        if step in SPIKE_STEPS:
            loss += 1.0
        if step == NAN_STEP:
            loss = float("nan")
        record = {"step": step, "loss": loss, "grad_norm": 1.0 + 0.01 * step if step != 3 else None,
                  "lr": 1e-3 * min(1.0, step / 10), "update_skipped": False, "step_time_s": 0.5,
                  "tokens": step * 2048, "tokens_per_s": 4096.0, "stem_rows_fetched": 100 + step,
                  "stem_cache_hit_rate": None, "moe_tokens_per_expert": EXPERTS,
                  "moe_load_max_over_mean": 1.5}
        record.update(det.update(loss))
        out.append(record)
    return out


@pytest.fixture(scope="module")
def wandb_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("wandb_env")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(root / "wandb_dir"),
           "WANDB_DATA_DIR": str(root / "data"), "WANDB_CACHE_DIR": str(root / "cache"),
           "WANDB_CONFIG_DIR": str(root / "config"), "WANDB_ARTIFACT_DIR": str(root / "artifacts"),
           "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_DISABLE_CODE": "true"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield root
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def offline_run(wandb_env):
    """One offline run: the real RunConfig, 60 records with 2 spikes and a NaN loss; read back once."""
    import wandb

    cfg = RunConfig(stem=STEMConfig(variant="stem", ratio="1/3"), out_dir=str(wandb_env / "run"))
    config = dataclasses.asdict(cfg)
    records = _records()
    checkpoints = wandb_env / "checkpoints"
    for step in (20, 40, 60):  # sealed ones (a manifest), and one that is not
        (checkpoints / f"step_{step:06d}").mkdir(parents=True)
        (checkpoints / f"step_{step:06d}" / ("manifest.json" if step != 40 else "part")).write_text("{}")
    tracker = WandbTracker(cfg.out_dir, config, project="stem-megatron-test", mode="offline",
                           tags=["test", "stem"], settings={"x_disable_stats": True, "console": "off"},
                           checkpoints=checkpoints)
    for r in records:
        tracker.log(r)
    path = tracker.run_path
    tracker.finish()
    tracker.finish()  # idempotent
    assert tracker.run_path == path  # still there for printing the `wandb sync` command
    wandb.teardown()
    return {"path": path, "config": config, "records": records,
            "log": inspect_offline_run(path), "summary": inspect_offline_run(path, summary=True)}


def test_offline_run_is_written_under_the_run_dir(offline_run, wandb_env):
    path = offline_run["path"]
    assert path.parent == wandb_env / "run" / "wandb"
    assert path.name.startswith("offline-run-")
    assert len(list(path.glob("run-*.wandb"))) == 1
    assert offline_run["summary"]["state"] == "finished" and offline_run["summary"]["exit_code"] == 0


def test_config_round_trips(offline_run):
    summary = offline_run["summary"]
    assert summary["config"] == json.loads(json.dumps(offline_run["config"]))
    assert summary["config"]["stem"]["variant"] == "stem" and summary["config"]["stem"]["ratio"] == "1/3"
    assert summary["project"] == "stem-megatron-test"
    assert summary["name"] == "tiny-stem-1/3"
    assert summary["tags"] == ["test", "stem"]


def test_logged_values_round_trip(offline_run):
    history = {h["_step"]: h for h in (r["history"]["item"] for r in offline_run["log"] if r["type"] == "history")}
    assert sorted(history) == list(range(1, STEPS + 1))
    for r in offline_run["records"]:
        h = history[r["step"]]
        if math.isfinite(r["loss"]):
            assert h["loss"] == r["loss"]  # exact: float64 survives the transaction log
        else:
            assert h["loss"] == "NaN"  # non-finite values are kept, JSON-encoded as strings
        assert h["lr"] == r["lr"] and h["tokens_per_s"] == r["tokens_per_s"]
        assert h["loss_spike"] == int(r["loss_spike"]) and h["loss_spike_count"] == r["loss_spike_count"]
        assert ("grad_norm" in h) == (r["grad_norm"] is not None)  # None is skipped, not logged
        assert "stem_cache_hit_rate" not in h
        assert h["stem_rows_fetched"] == r["stem_rows_fetched"]
        # per-expert load: one histogram bin per expert holding its token count
        assert h["moe_tokens_per_expert._type"] == "histogram"
        assert h["moe_tokens_per_expert.values"] == EXPERTS
        assert h["moe_tokens_per_expert.bins"] == list(range(len(EXPERTS) + 1))


def test_spike_events_in_summary_and_table(offline_run):
    flagged = [r["step"] for r in offline_run["records"] if r["loss_spike"]]
    assert flagged == [*SPIKE_STEPS, NAN_STEP]
    summary = offline_run["summary"]["summary"]
    assert summary["loss_spike_count"] == 3
    assert summary["loss_spike_steps"] == flagged
    table = summary["loss_spikes"]
    assert table["_type"] == "table-file" and table["nrows"] == 3
    rows = json.loads((offline_run["path"] / "files" / table["path"]).read_text())
    assert rows["columns"] == ["step", "loss", "size", "rollback"]
    by_step = {row[0]: row for row in rows["data"]}
    sealed = offline_run["path"].parents[2] / "checkpoints" / "step_000020"  # the newest sealed one before each
    assert [by_step[step][3] for step in flagged] == [
        f"checkpoint.load={sealed} train.skip_steps=[21-{step}]" for step in flagged]
    assert sorted(by_step) == flagged
    sizes = {r["step"]: r["loss_spike_size"] for r in offline_run["records"] if r["loss_spike"]}
    for step in SPIKE_STEPS:
        assert by_step[step][2] == pytest.approx(sizes[step]) and sizes[step] > 4.0
    assert by_step[NAN_STEP][2] is None


def test_disabled_tracker_is_a_no_op(tmp_path):
    for tracker in (WandbTracker(tmp_path, {}, enabled=False), WandbTracker(tmp_path, {}, mode="disabled")):
        tracker.log({"step": 1, "loss": 1.0})
        tracker.finish()
        assert tracker.run is None and tracker.run_path is None
    assert not (tmp_path / "wandb").exists()
    with pytest.raises(ValueError):
        WandbTracker(tmp_path, {}, mode="cloud")


# -- FLOPs, TFLOP/s, MFU -------------------------------------------------------------------------------

BENCH_MODEL = ModelConfig(name="bench", num_layers=6, hidden_size=256, ffn_hidden_size=768, num_attention_heads=4,
                          vocab_size=4096, seq_length=128)


def test_model_flops_match_the_flop_counter_of_the_megatron_model():
    """benchmarks/ffn_cost.py counts these with torch.utils.flop_counter on megatron-core's GPTModel
    (docs/benchmarks.md: 39.32 / 36.96 / 33.42 MFLOP per token, fwd+bwd)."""
    assert model_flops_per_token(BENCH_MODEL, STEMConfig(variant="dense")) == 39_321_600
    assert model_flops_per_token(BENCH_MODEL, STEMConfig(variant="stem", ratio="1/3")) == 36_962_304
    assert model_flops_per_token(BENCH_MODEL, STEMConfig(variant="stem", ratio="full")) == 33_423_360
    assert model_flops_per_token(BENCH_MODEL) == 39_321_600
    # config.json dicts work too; STEM-dagger keeps all three matmuls; a Hash-MoE layer runs one expert
    as_dict = dataclasses.asdict(BENCH_MODEL)
    assert model_flops_per_token(as_dict, {"variant": "stem", "ratio": "1/3"}) == 36_962_304
    assert model_flops_per_token(BENCH_MODEL, STEMConfig(variant="stem_dagger", ratio="1/2")) == 39_321_600
    moe = STEMConfig(variant="hash_moe", ratio="1/3"), HashMoEConfig(expert_ffn_hidden_size=576)
    assert model_flops_per_token(BENCH_MODEL, *moe) == 39_321_600 - 3 * 2 * (2 * 256 * (768 - 576) * 3)
    # grouped-query attention: 2 KV groups shrink K and V projections
    gqa = dataclasses.replace(BENCH_MODEL, num_query_groups=2)
    assert model_flops_per_token(BENCH_MODEL) - model_flops_per_token(gqa) == 3 * 6 * 2 * 256 * 128 * 2


def test_throughput_and_mfu(monkeypatch):
    m = throughput_metrics(tokens_per_s=10_000.0, flops_per_token=1e9, peak_tflops=None, num_devices=2)
    assert m == {"tflops_per_s": 10.0, "tflops_per_s_per_device": 5.0, "mfu": None}
    m = throughput_metrics(tokens_per_s=10_000.0, flops_per_token=1e9, peak_tflops=312.0, num_devices=2)
    assert m["mfu"] == pytest.approx(5.0 / 312.0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the current device's name decides
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    assert device_peak_tflops() == 989.0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU run has no peak
    assert device_peak_tflops() is None
    names = {"NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA A100 80GB PCIe": 312.0, "NVIDIA H100 80GB HBM3": 989.0,
             "NVIDIA H100 PCIe": 756.0, "NVIDIA H100 NVL": 835.0, "NVIDIA H200": 989.0, "NVIDIA A10": 125.0,
             "NVIDIA L4": 121.0, "NVIDIA L40S": 362.0, "NVIDIA B200": 2250.0, "Tesla V100-SXM2-32GB": None}
    assert {n: device_peak_tflops(n) for n in names} == names


# -- dashboard spec and plot tool ---------------------------------------------------------------------

def test_dashboard_spec_builds_offline_and_reads_logged_metrics(offline_run):
    dash = _load_tool("wandb_dashboard")
    viewspec = dash.offline_viewspec(dash.DASHBOARD, "some-entity", "stem-megatron")
    grids = [b for b in viewspec["blocks"] if b.get("type") == "panel-grid"]
    assert len(grids) == len(dash.DASHBOARD["sections"])
    runset = grids[0]["metadata"]["runSets"][0]
    assert runset["grouping"] == [{"section": "config", "name": "stem.value.variant"},
                                  {"section": "config", "name": "stem.value.ratio"}]
    charts = [p["config"].get("chartTitle") for p in grids[0]["metadata"]["panelBankSectionConfig"]["panels"]]
    assert "training loss" in charts and "loss spikes so far" in charts
    # every metric the panels plot is one the training loop logs (or a throughput field it adds)
    logged = set()
    for r in offline_run["log"]:
        if r["type"] == "history":
            logged |= {k.split(".")[0] for k in r["history"]["item"]}
    loop_fields = {"tflops_per_s_per_device", "mfu", "stem_prefetch_wait_s", "stem_node_bytes_sent",
                   "stem_node_bytes_received", "stem_node_rows_updated", "stem_exchange_s", "stem_exchange_wait_s",
                   "dense_grad_norm", "stem_grad_norm"}
    assert dash.panel_metrics(dash.DASHBOARD) <= logged | loop_fields
    # the grouping keys exist in the logged config
    assert {"variant", "ratio"} <= set(offline_run["summary"]["config"]["stem"])


def _write_run(path, records, variant, ratio):
    path.mkdir(parents=True)
    cfg = dataclasses.asdict(RunConfig(stem=STEMConfig(variant=variant, ratio=ratio)))
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_plot_tool_writes_a_png(tmp_path, capsys):
    plot = _load_tool("plot_metrics")
    records = _records()
    _write_run(tmp_path / "stem", records, "stem", "1/3")
    # the dense run's file holds an aborted first attempt, and no spike fields (detected by the tool)
    dense = [{k: v for k, v in r.items() if not k.startswith("loss_spike")} for r in records]
    dense = dense[:5] + [{**r, "loss": r["loss"] + 0.1} for r in dense]
    _write_run(tmp_path / "dense", dense, "dense", "0")
    out = tmp_path / "out" / "plot.png"
    plot.main([str(tmp_path / "dense"), str(tmp_path / "stem"), "--out", str(out),
               "--spike-window", "20", "--spike-warmup", "10"])
    printed = capsys.readouterr().out
    assert "dense: 60 steps, 3 loss spikes" in printed and "stem-1/3: 60 steps, 3 loss spikes" in printed
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert plot.run_label(tmp_path / "dense") == "dense" and plot.run_label(tmp_path / "stem") == "stem-1/3"


def test_a_requeued_job_continues_the_run_and_a_rollback_says_so(wandb_env, capsys):
    """Jobs on one run directory as requeues leave it: steps 1-5, then 6-8 (resumed after step 5), then 4-6 (resumed
    after step 3, an earlier checkpoint): one W&B run id, each job offline in a directory of its own; the third says
    ``rollback_to_step`` 3 in its history, summary and notes, and in a line; a new run (resumed after 0) a new id."""
    run_dir, jobs = wandb_env / "requeued", []
    for resumed, steps in ((None, range(1, 6)), (5, range(6, 9)), (3, range(4, 7)), (0, range(1, 3))):
        tracker = WandbTracker(run_dir, {}, project="stem-megatron-test", resumed=resumed,
                               settings={"x_disable_stats": True, "console": "off"})
        for step in steps:
            tracker.log({"step": step, "loss": 1.0 / step})
        jobs.append((tracker.run.id, tracker.run_path))
        tracker.finish()
    ids = [run_id for run_id, _ in jobs]
    assert ids[0] == ids[1] == ids[2] != ids[3] and len({path for _, path in jobs}) == 4
    said = capsys.readouterr().out
    assert said.count("rollback") == 1 and (f"W&B run {ids[0]}: resumed after step 3, before its last logged step 8: "
                                            f"steps 4-8 are logged again") in said
    summaries = [inspect_offline_run(path, summary=True) for _, path in jobs[1:3]]
    assert "rollback_to_step" not in summaries[0]["summary"] and summaries[1]["summary"]["rollback_to_step"] == 3
    assert summaries[1]["notes"] == "rolled back to step 3 after step 8. "
    history = [r["history"]["item"] for r in inspect_offline_run(jobs[2][1]) if r.get("type") == "history"]
    assert [(h["_step"], h.get("rollback_to_step")) for h in history] == [(4, 3), (5, None), (6, None)]
    assert json.loads((run_dir / "wandb_run.json").read_text()) == {"id": ids[3], "last_step": 2}
