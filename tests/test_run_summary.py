"""The operator's view (training/run_summary.py): the start block of the paper's 1B run on 8 nodes says its model,
parameters (those megatron builds: tests/test_param_counts.py), STEM layers, placement, layout and the memory plan
of ``stem-flops --memory``; a step line's ETA and memory. A real run's lines: tests/test_preemption.py."""

import pytest

from stem_megatron.config import RunConfig
from stem_megatron.flops.memory import Layout, plan
from stem_megatron.recipes import compose_run
from stem_megatron.training.run_summary import StepClock, eta_text, start_block


def test_the_start_block_of_the_1b_run_on_8_nodes():
    cfg = compose_run(["+experiment=pretrain_1b", "variant=stem_1_3"])
    model, stem, layout, plan_line = start_block(cfg, world=64, ranks_per_node=8, gpu=False)
    # 1,414,596,608 + 5,253,365,760: within 2% of the paper's 1.41B active of 6.75B (tests/test_param_counts.py)
    assert model == ("model: 16 layers, d 2048, d_ff 8192, V 128256, sequence 4096; 1.41B dense parameters + 5.25B "
                     "in STEM tables")
    assert stem == "stem in layer(s) 3, 6, 9, 12, 16 of 16: tables in host memory (/dev/shm), dense AdamW on the CPU"
    assert layout == ("layout: 8 node(s) x 8 CPU rank(s), TP=1 PP=1 DP=64 EP=1; global batch 512 = 4 x DP 64 x 2 "
                      "micro-batch(es), 2,097,152 tokens a step; DP reductions during backward, weight all-gathers "
                      "during forward")
    node = max(plan(cfg, Layout(8, 8, 1, 1, "cpu", False))["nodes"], key=lambda n: n["total"])
    assert plan_line.startswith(f"memory plan: {node['total'] / 2**30:.2f} GiB a node, "
                                f"{sum(node['shared'].values()) / 2**30:.2f} GiB of it shared in /dev/shm; this "
                                f"node: MemAvailable ")
    assert plan_line.endswith(": does NOT fit")  # tens of GiB of tables: not on this machine


def test_a_layout_the_plan_does_not_model_is_said_not_computed():
    cfg = RunConfig()
    cfg.parallel.pipeline_model_parallel_size, cfg.model.num_layers, cfg.train.global_batch_size = 2, 4, 48
    lines = start_block(cfg, world=24, ranks_per_node=8, gpu=False)  # 2 stages of 12 ranks over 3 nodes of 8
    assert lines[-1].startswith("memory plan: not computed (") and "nor divide a node" in lines[-1], lines[-1]


def test_the_eta_follows_the_recent_steps(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("stem_megatron.training.run_summary.time.monotonic", lambda: now[0])
    clock = StepClock(last_step=10, window=2)
    for step, seconds in ((1, 5.0), (2, 1.0), (3, 3.0)):
        now[0] += seconds
        out = clock.tick(step)
    assert out["eta_s"] == pytest.approx(7 * 2.0)  # the mean of the last two steps, 7 steps to go
    assert out["memory_gib"] > 0.01
    assert [eta_text(s) for s in (14, 3725, 200000)] == ["0m14s", "1h02m", "2d07h"]
