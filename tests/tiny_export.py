"""The tiny model the export-based tests share: its config over the test corpus, and its initial weights
perturbed so no layer is trivial. A plain module, not a fixture: spawned workers (``distributed.run``)
import the functions they are given by module name."""

import torch
from conftest import VOCAB

from stem_megatron.config import DataConfig, HashMoEConfig, ModelConfig, RunConfig, STEMConfig

D, D_FF = 32, 96


def tiny_config(corpus, num_layers: int, seq_length: int, hash_moe: HashMoEConfig | None = None, **stem) -> RunConfig:
    """d=32, d_ff=96, 4 heads; by default STEM at ratio full (layer 0 a dense SwiGLU FFN, the others STEM);
    ``hash_moe``: the experts of ``variant="hash_moe"``."""
    return RunConfig(
        model=ModelConfig(num_layers=num_layers, hidden_size=D, ffn_hidden_size=D_FF, num_attention_heads=4,
                          vocab_size=VOCAB, seq_length=seq_length),
        stem=STEMConfig(**({"variant": "stem", "ratio": "full"} | stem)),
        hash_moe=hash_moe or HashMoEConfig(),
        data=DataConfig(dir=str(corpus), vocab_size=VOCAB),
    )


def perturbed_weights(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """The single-process model's freshly initialised weights plus seeded noise (std 0.02)."""
    from stem_megatron.export.single_process import build_single_process_model

    g = torch.Generator().manual_seed(0)
    return {n: p.detach() + 0.02 * torch.randn(p.shape, generator=g)
            for n, p in build_single_process_model(cfg).named_parameters()}


def write_tiny_export(cfg: RunConfig, out) -> None:
    """``out``: an export of ``cfg`` with ``perturbed_weights`` (needs megatron: run it in a spawned process)."""
    from stem_megatron.export.format import write_export

    write_export(out, cfg, perturbed_weights(cfg))
