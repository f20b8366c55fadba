"""A step's record from what it measured (training/components/step_meter.py): the step's outputs, time, tokens and
ETA, then the host tables' counters and the wait for their rows (none without host tables), Hash-MoE's, throughput,
in the order metrics.jsonl keeps them."""

from types import SimpleNamespace

import pytest
import torch

from stem_megatron.config import RunConfig
from stem_megatron.host_tables.placement import NoTables
from stem_megatron.training.components import step_meter as module
from stem_megatron.training.components.step_meter import StepMeter


class Store:
    """Stands in for the host table store: counters that a take resets, and the stream's wait for rows."""

    def __init__(self):
        self.rows = 0

    def take_stats(self, stream):
        stats, self.rows = {"stem_rows_fetched": self.rows, "stem_prefetch_wait_s": stream.take_wait_s()}, 0
        return stats


class Stream:
    def take_wait_s(self):
        return 0.25


@pytest.mark.parametrize("host_tables", [True, False])
def test_the_record_holds_each_measure_once_in_its_order(world_of_one, monkeypatch, host_tables):
    monkeypatch.setattr(module, "take_moe_stats", lambda model: {"moe_all_to_all_bytes": 64})
    cfg = RunConfig()
    cfg.train.global_batch_size, cfg.model.seq_length = 4, 32  # 128 tokens a step
    store = Store() if host_tables else NoTables()
    meter = StepMeter(cfg, SimpleNamespace(tables=store, model=torch.nn.Linear(2, 2)), last_step=10)
    if host_tables:
        store.rows = 7
    record = meter.record(3, {"loss": 2.0, "lr": 1e-3}, 0.5, Stream())
    tables = ["stem_rows_fetched", "stem_prefetch_wait_s"] if host_tables else []
    assert list(record) == ["step", "loss", "lr", "step_time_s", "tokens", "tokens_per_s", "eta_s", "memory_gib",
                            *tables, "moe_all_to_all_bytes", "tflops_per_s", "tflops_per_s_per_device", "mfu"]
    assert (record["step"], record["tokens"], record["tokens_per_s"], record["mfu"]) == (3, 384, 256.0, None)
    assert record["tflops_per_s"] == 256.0 * meter.flops_per_token / 1e12
    if host_tables:
        assert (record["stem_rows_fetched"], record["stem_prefetch_wait_s"]) == (7, 0.25)
        assert meter.record(4, {"loss": 2.0}, 0.5, Stream())["stem_rows_fetched"] == 0  # taken: the next starts at 0
