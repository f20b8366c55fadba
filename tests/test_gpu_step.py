"""``benchmarks/gpu_step.py`` on the CPU (tiny shapes) gives a complete, sane record per variant and a
profile of one step; a run out of device memory ends with one line (the memory plan's bytes and the settings that
lower it) and exit code 1, not Hydra's traceback; the fields it sets (``logging.profile_step``, ``checkpoint.save``)
are validated."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import VOCAB

from stem_megatron.config import ConfigError, RunConfig, validate, validate_layout
from stem_megatron.training.device_memory import out_of_memory_in

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("dense", "stem_1_3_device", "stem_1_3_host_lazy", "stem_1_3_resident_fit")


@pytest.mark.slow
def test_benchmark_records_every_variant_on_the_cpu(tmp_path):
    out = tmp_path / "records.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_step.py"), "--shapes", "tiny",
                           "--variants", ",".join(VARIANTS), "--steps", "3", "--warmup", "1",
                           "--out", str(tmp_path / "bench"), "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    records = {r["variant"]: r for r in result["records"]}
    assert set(records) == set(VARIANTS)
    for name, r in records.items():
        assert r["status"] == "ok", (name, r["note"])
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0 and r["steps_timed"] == [2]
        assert r["mfu"] is None  # no peak on the CPU
        assert r["peak_memory_kind"] == "peak_rss" and r["peak_memory_bytes"] > 0
        assert r["plan_device_bytes"] > 0
        assert r["ratio_to_dense"] == pytest.approx(r["step_time_s"] / records["dense"]["step_time_s"])
        ops = r["profile"]["by_self_cpu"]
        assert len(ops) == 8 and all(op["name"] and op["calls"] > 0 for op in ops), ops
        assert any(op["name"].startswith("aten::mm") for op in ops)
        assert Path(r["profile"]["table"]).read_text().startswith("step 3: ops by self CPU time")
    assert records["dense"]["ratio_to_dense"] == 1.0
    host = records["stem_1_3_host_lazy"]
    assert host["optimizer"] == "lazy"
    assert host["stem"]["stem_cpu_adam_s"] > 0 and host["stem"]["stem_bytes_to_device"] > 0
    assert host["stem"]["stem_bytes_from_device"] > 0
    assert records["stem_1_3_device"]["stem"] == {} and records["dense"]["stem"] == {}
    # the working set sized to the memory goal: the most rows whose plan (at the profile's distinct ids, which the
    # run's own counts match) stays within 1.10x dense's; a step's rows fit in it
    fit = records["stem_1_3_resident_fit"]
    rows = json.loads((Path(fit["out_dir"]) / "config.json").read_text())["host_tables"]["resident_rows"]
    assert fit["label"] == f"STEM-1/3 working set {rows:,}" and f"STEM-1/3 working set {rows:,}" in proc.stdout
    micro, step = fit["distinct_ids"]
    assert step < rows and fit["plan_device_bytes"] <= 1.10 * records["dense"]["plan_device_bytes"]
    assert fit["stem"]["stem_bytes_to_device"] == 0  # the forward reads its rows from the set's slots
    counted = [json.loads(line)["stem_unique_tokens"] / 2
               for line in (Path(fit["out_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert all(0.8 * micro <= c <= 1.2 * micro for c in counted), (counted, micro)
    # the printed table: one row per variant, under its header
    assert re.search(r"^dense\s+[\d.]+\s+[\d,]+\s+-\s+[\d.]+\s+[\d.]+\s+1\.00\s", proc.stdout, re.M), proc.stdout
    assert re.search(r"^STEM-1/3 host, lazy Adam\s+[\d.]+\s+[\d,]+\s+-\s+", proc.stdout, re.M), proc.stdout
    assert "STEM-1/3 device tables" in proc.stdout and "top 8 ops by self CPU time" in proc.stdout
    assert not list((tmp_path / "bench").rglob("checkpoints")), "checkpoint.save=false wrote a checkpoint"


OOM_RUN = """
import sys, torch
import stem_megatron.training.loop as loop

def out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB")

loop.train_step = out_of_memory
sys.argv = ["stem-train", *sys.argv[1:]]
from stem_megatron.train import main
main()
"""


def test_out_of_device_memory_ends_the_run_with_one_line(corpus, tmp_path):
    """A step that raises torch.OutOfMemoryError (simulated on the CPU): exit code 1 and one line with the memory
    plan's bytes for this run and the settings that lower it."""
    overrides = ["model=tiny", "parallel=single", "variant=stem_1_3", "host_tables.placement=device",
                 f"data.dir={corpus}", f"data.vocab_size={VOCAB}", "train.steps=2", "train.eval_iters=0",
                 "train.micro_batch_size=4", "train.global_batch_size=8", "checkpoint.save=false",
                 f"out_dir={tmp_path / 'run'}"]
    proc = subprocess.run([sys.executable, "-c", OOM_RUN, *overrides], capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out and "Error executing job" not in out, out[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, proc.stderr

    from stem_megatron.flops.memory import GIB, Layout, plan
    from stem_megatron.recipes import compose_run

    planned = plan(compose_run(overrides), Layout(1, 1, 1, 1, "cpu"))["stages"][0]["device_total"]
    line = lines[0]
    assert line.startswith("error: out of memory on the CPU while allocating 2.00 GiB: the memory plan expects "
                           f"{planned / GIB:.2f} GiB per rank for this run"), line
    for knob in ("train.micro_batch_size (now 4", "parallel.tensor_model_parallel_size",
                 "parallel.pipeline_model_parallel_size", "host_tables.placement=host"):
        assert knob in line, line


def test_an_out_of_memory_error_is_found_behind_the_error_raised_from_it():
    oom = torch.OutOfMemoryError("CUDA out of memory")
    try:
        try:
            raise oom
        except torch.OutOfMemoryError as e:
            raise RuntimeError("STEM row prefetch failed") from e
    except RuntimeError as wrapped:
        assert out_of_memory_in(wrapped) is oom
    assert out_of_memory_in(ValueError("no")) is None


@pytest.mark.parametrize("change, field", [
    (lambda c: setattr(c.logging, "profile_step", 0), "logging.profile_step"),
    (lambda c: setattr(c.logging, "profile_step", 51), "logging.profile_step"),
    (lambda c: setattr(c.logging, "collective_audit", 0), "logging.collective_audit"),
    (lambda c: setattr(c.logging, "sync_audit", 51), "logging.sync_audit"),
    (lambda c: (setattr(c.checkpoint, "save", False), setattr(c.checkpoint, "save_interval", 10)),
     "checkpoint.save_interval"),
    (lambda c: (setattr(c.checkpoint, "save", False), setattr(c.train, "exit_after_steps", 5)),
     "train.exit_after_steps"),
])
def test_profile_step_and_save_are_validated(change, field):
    cfg = RunConfig()
    cfg.logging.profile_step, cfg.logging.collective_audit, cfg.checkpoint.save = 50, 1, False
    validate_layout(cfg, 1)  # the last step may be profiled; no checkpoint at all is fine
    change(cfg)
    with pytest.raises(ConfigError, match=re.escape(field)):
        validate_layout(cfg, 1)


def test_a_sync_audit_needs_a_gpu():
    """The sync audit counts CUDA synchronisations: a CPU run that asks for one is told so before it starts."""
    cfg = RunConfig()
    cfg.host_tables.placement, cfg.logging.sync_audit = "device", 2
    with pytest.raises(ConfigError, match=r"logging\.sync_audit.*no GPU"):
        validate(cfg, 1)


@pytest.mark.slow
def test_make_bench_counts_two_thirds_of_the_ffn_flops():
    """`make bench` (benchmarks/ffn_cost.py) on megatron-core 0.19, whose local layer spec gives the dense MLP as a
    factory: one STEM FFN's matmul FLOPs are exactly 2/3 of the dense one's (the script asserts it), and each whole
    model saves exactly that third of an FFN per replaced layer (6 layers: 2 at ratio 1/3, all but the first at
    full)."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "benchmarks/ffn_cost.py", "--steps", "2", "--warmup", "1", "--json"],
                          capture_output=True, text=True, cwd=root, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert out["ffn"]["ratio_fwd"] == out["ffn"]["ratio_fwd_bwd"] == "2/3"
    assert out["ffn"]["stem"]["fwd"] * 3 == out["ffn"]["dense"]["fwd"] * 2
    saved = out["ffn"]["dense"]["fwd_bwd"] - out["ffn"]["stem"]["fwd_bwd"]
    flops = {name: m["flops_per_token"] for name, m in out["model"].items()}
    assert flops["dense"] - flops["stem-1/3"] == 2 * saved and flops["dense"] - flops["stem-full"] == 5 * saved
