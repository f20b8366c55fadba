"""Hash-MoE baseline: token -> expert maps, end-to-end routing through megatron's dispatcher at EP=2,
parameter counts against Table 3, and a clear error where megatron cannot run it on CPU."""

import distributed
import numpy as np
import pytest
import torch

from stem_megatron.config import (
    ConfigError,
    DataConfig,
    HashMoEConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    STEMConfig,
    validate,
)
from stem_megatron.model.hash_moe import frequency_balanced_map, random_balanced_map

V, E = 64, 4
MODEL = ModelConfig(num_layers=3, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=V,
                    seq_length=16)


def test_random_map_is_seeded_and_balanced():
    a, b = random_balanced_map(1000, 16, seed=3), random_balanced_map(1000, 16, seed=3)
    assert torch.equal(a, b) and not torch.equal(a, random_balanced_map(1000, 16, seed=4))
    sizes = torch.bincount(a, minlength=16)
    assert sizes.max() - sizes.min() <= 1


def test_frequency_map_balances_token_mass():
    counts = np.random.default_rng(0).zipf(1.3, size=2000).clip(max=10_000).astype(np.float64)
    experts = frequency_balanced_map(counts, 8).numpy()
    mass = np.bincount(experts, weights=counts, minlength=8)
    naive = np.bincount(random_balanced_map(2000, 8, seed=0).numpy(), weights=counts, minlength=8)
    assert mass.max() / mass.mean() < 1.05  # greedy LPT: near-equal token mass ...
    assert mass.max() / mass.mean() < naive.max() / naive.mean()  # ... better than a vocabulary split


def _tokens_reaching_experts():
    """A one-layer Hash-MoE model whose attention output is zeroed, so each expert's input rows are
    RMSNorm(embedding[t]): every row an expert receives through megatron's all-to-all dispatcher is
    matched back to the token id it came from."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from stem_megatron.training.setup import setup_model
    from stem_megatron.training.step import forward_backward

    model_cfg = ModelConfig(**{**MODEL.__dict__, "num_layers": 1})
    trainer = setup_model(RunConfig(model=model_cfg, stem=STEMConfig(variant="hash_moe", layers=[0]),
                                    hash_moe=HashMoEConfig(num_experts=E),
                                    parallel=ParallelConfig(expert_model_parallel_size=2)))
    gpt = trainer.model.module
    layer = gpt.decoder.layers[0]
    moe = layer.mlp
    assert isinstance(moe, MoELayer)
    with torch.no_grad():
        layer.self_attention.linear_proj.weight.zero_()
        keys = layer.pre_mlp_layernorm(gpt.embedding.word_embeddings.weight)  # what expert inputs look like
    received = {}
    for j, expert in enumerate(moe.experts.local_experts):
        def hook(module, args, out, e=moe.local_expert_indices[j]):
            received[e] = torch.cdist(args[0].detach(), keys).argmin(dim=1)
        expert.register_forward_hook(hook)
    tokens = torch.randint(0, V, (2, MODEL.seq_length),
                           generator=torch.Generator().manual_seed(parallel_state.get_data_parallel_rank()))
    forward_backward(trainer.model, iter([{"tokens": tokens, "labels": tokens}]), 1, 2, MODEL.seq_length, V)
    return {"received": received, "tokens": tokens, "map": moe.router.expert_of_token.clone()}


@pytest.mark.slow
def test_every_token_reaches_the_expert_its_id_maps_to():
    results = distributed.run(_tokens_reaching_experts, 2, ep=2)
    expert_of_token = results[0]["map"]
    assert torch.equal(expert_of_token, results[1]["map"])
    all_tokens = torch.cat([r["tokens"].flatten() for r in results])
    received = {e: ids for r in results for e, ids in r["received"].items()}
    assert sorted(received) == list(range(E))  # each expert lives on one EP rank
    for e, ids in received.items():
        assert (expert_of_token[ids] == e).all(), f"expert {e} received tokens mapped elsewhere"
        assert sorted(ids.tolist()) == sorted(all_tokens[expert_of_token[all_tokens] == e].tolist())


def test_tensor_parallel_hash_moe_fails_early_on_cpu():
    cfg = RunConfig(model=MODEL, stem=STEMConfig(variant="hash_moe"), hash_moe=HashMoEConfig(num_experts=E),
                    parallel=ParallelConfig(tensor_model_parallel_size=2), data=DataConfig(vocab_size=MODEL.vocab_size))
    with pytest.raises(ConfigError, match="parallel.sequence_parallel"):
        validate(cfg, 2)
    cfg.parallel.sequence_parallel = True
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="Transformer Engine"):
            validate(cfg, 2)
    with pytest.raises(ConfigError, match="hash_moe.num_experts"):
        validate(RunConfig(model=MODEL, stem=STEMConfig(variant="hash_moe"), hash_moe=HashMoEConfig(num_experts=3),
                           parallel=ParallelConfig(expert_model_parallel_size=2)), 2)
    with pytest.raises(ConfigError, match="expert_model_parallel_size"):
        validate(RunConfig(model=MODEL, parallel=ParallelConfig(expert_model_parallel_size=2)), 2)
