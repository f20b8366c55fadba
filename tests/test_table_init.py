"""``stem.table_init``: the std each setting gives, measured on both placements, and the same table on both."""

import math

import distributed
import pytest
import torch

from stem_megatron.config import ModelConfig, ParallelConfig, RunConfig, STEMConfig
from stem_megatron.flops.arch import REPO
from stem_megatron.model.device_table import table_init_std
from stem_megatron.model.gpt import transformer_config

# V not a multiple of the 4096 rows drawn per generator: the last, partial block is covered too
MODEL = ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=512, num_attention_heads=4, vocab_size=9000)
CASES = [("scaled", None, 0.02 * math.sqrt(64)), ("xavier", None, math.sqrt(2 / (9000 + 512))), ("xavier", 0.5, 0.5)]


def _preset(name: str) -> ModelConfig:
    from omegaconf import OmegaConf

    return ModelConfig(**OmegaConf.to_container(OmegaConf.load(REPO / "recipes" / "model" / f"{name}.yaml")))


@pytest.mark.parametrize("preset, scaled, xavier", [("mobilellm_350m", 0.620, 0.0076), ("llama3.2_1b", 0.905, 0.0038)])
def test_std_per_setting(preset, scaled, xavier):
    """The issue's numbers: xavier (released code) is 81x / 236x smaller than scaled; an explicit std wins."""
    m = _preset(preset)
    config = transformer_config(m, ParallelConfig(), on_gpu=False)
    assert table_init_std(config, m.vocab_size, "scaled") == pytest.approx(scaled, rel=1e-3)
    assert table_init_std(config, m.vocab_size, "xavier") == pytest.approx(xavier, rel=1e-2)
    assert table_init_std(config, m.vocab_size, "xavier", 0.1) == table_init_std(config, m.vocab_size, "scaled", 0.1)
    with pytest.raises(ValueError, match="stem.table_init"):
        table_init_std(config, m.vocab_size, "normal")


def _both_placements():
    """Per case: this TP rank's slice of each table on the device and in the host store, and the full host tables."""
    from megatron.core import parallel_state

    from stem_megatron.host_tables.placement import build_tables
    from stem_megatron.model.gpt import build_gpt
    from stem_megatron.model.stem_mlp import STEMMLP
    from stem_megatron.run_plan import micro_batches_per_step

    out = []
    for table_init, std, _ in CASES:
        cfg = RunConfig(model=MODEL, stem=STEMConfig(ratio="1/2", table_init=table_init, table_init_std=std),
                        parallel=ParallelConfig(tensor_model_parallel_size=2))
        tconfig = transformer_config(cfg.model, cfg.parallel, on_gpu=False, stem=cfg.stem)
        store = build_tables(cfg, tconfig, torch.device("cpu"),
                             micro_batches_per_step(cfg, parallel_state.get_data_parallel_world_size()))
        model = build_gpt(cfg.model, cfg.stem, tconfig, seed=cfg.train.seed)
        device = {m.layer_number: m.U_l.weight.detach().clone() for m in model.modules() if isinstance(m, STEMMLP)}
        cols = slice(store.tp_rank * store.cols, (store.tp_rank + 1) * store.cols)  # the store keeps rows by owner
        out.append((device, {layer: store.table(layer)[:, cols] for layer in store.layers},
                    {layer: store.table(layer) for layer in store.layers}))
    return out


@pytest.mark.slow
def test_device_and_host_tables_are_drawn_alike():
    """Bitwise the same values on both placements (TP=2: each rank's column slice), the std of each setting."""
    for per_rank in distributed.run(_both_placements, 2, tp=2):
        for (table_init, std, expected), (device, host, full) in zip(CASES, per_rank):
            assert sorted(device) == sorted(host) == [2, 4]
            for layer in host:
                assert torch.equal(device[layer], host[layer]), f"{table_init}: layer {layer} differs on the device"
                assert full[layer].std().item() == pytest.approx(expected, rel=0.02), (table_init, std)
                assert full[layer].mean().abs().item() < 0.01 * expected
            assert not torch.equal(full[2], full[4])  # each layer draws its own table
