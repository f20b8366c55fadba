"""The whole model under TP=2, PP=2, DP=2 (and TP=2 x PP=2), and the Hash-MoE model under EP=2 (and
PP=2 x EP=2), give the losses, gradients and updated weights of the same weights trained on one
process (megatron DDP, distributed optimizer, schedules, all-to-all token dispatcher). Hash-MoE with
TP needs sequence parallelism, which megatron-core runs only with GPU norms: not testable here."""

import distributed
import pytest
import torch

from stem_megatron.config import (
    HashMoEConfig,
    HostTablesConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    STEMConfig,
    TrainConfig,
)
from stem_megatron.model.sharding import load_full_weights, local_to_global, shard_of

MICRO, GLOBAL, STEPS = 2, 4, 3
MODEL = ModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=128,
                    seq_length=16)


def _data(dp_rank, dp):
    """The same global batch every step (so the loss must fall); micro-batch k of DP rank r holds
    sequences (k*dp + r)*MICRO ... of it."""
    g = torch.Generator().manual_seed(7)
    seqs = torch.randint(0, MODEL.vocab_size, (GLOBAL, MODEL.seq_length + 1), generator=g)
    for _ in range(STEPS):
        for k in range(GLOBAL // (MICRO * dp)):
            s = seqs[(k * dp + dp_rank) * MICRO:(k * dp + dp_rank + 1) * MICRO]
            yield {"tokens": s[:, :-1], "labels": s[:, 1:]}


VARIANTS = {  # the RunConfig groups of each
    "stem": dict(stem=STEMConfig(variant="stem", ratio="1/2"), host_tables=HostTablesConfig(placement="device")),
    "hash_moe": dict(stem=STEMConfig(variant="hash_moe", ratio="1/2"),
                     hash_moe=HashMoEConfig(num_experts=4, expert_ffn_hidden_size=32)),
}


def _train(variant, tp, pp, ep, dist_opt, ref=None):
    """Trains STEPS steps (from ``ref``'s initial weights if given).

    Without ``ref``: returns losses, step-1 gradients and weights under single-process names.
    With ``ref``: returns the max difference of each from ``ref``, sliced to this rank's shards.
    """
    from megatron.core import parallel_state

    from stem_megatron.training.setup import setup_model
    from stem_megatron.training.step import train_step

    cfg = RunConfig(model=MODEL, **VARIANTS[variant],
                    parallel=ParallelConfig(tp, pp, expert_model_parallel_size=ep, use_distributed_optimizer=dist_opt),
                    train=TrainConfig(steps=STEPS, micro_batch_size=MICRO, global_batch_size=GLOBAL, lr=1e-2))
    trainer = setup_model(cfg)
    model = trainer.model
    params = dict(model.module.named_parameters())
    names = local_to_global(model.module)
    if ref is not None:
        load_full_weights(model.module, ref["weights0"])
    snapshot = lambda get: {names[n]: get(p).detach().clone() for n, p in params.items()}  # noqa: E731
    result = {"weights0": snapshot(lambda p: p), "losses": []}
    dp = parallel_state.get_data_parallel_world_size()
    data = _data(parallel_state.get_data_parallel_rank(), dp)
    for step in range(STEPS):
        out = train_step(trainer, data, GLOBAL // (MICRO * dp), MICRO, MODEL.seq_length, MODEL.vocab_size)
        result["losses"].append(out["loss"])
        if step == 0:
            result["grads"] = snapshot(lambda p: p.main_grad)
    result["weights"] = snapshot(lambda p: p)
    if ref is None:
        return result

    errors = {"loss": max(abs(a - b) for a, b in zip(result["losses"], ref["losses"]))}
    # with the distributed optimizer at DP>1 only this rank's shard of the grad buffer is reduced
    compared = ("weights",) if dist_opt and dp > 1 else ("weights", "grads")
    for what in compared:
        errors[what] = max(
            (result[what][names[n]] - shard_of(ref[what][names[n]], p)).abs().max().item()
            for n, p in params.items()
        )
    return errors


_references: dict = {}


def _reference(variant):
    """Single-process run of ``variant`` (computed once per test session)."""
    if variant not in _references:
        _references[variant] = distributed.run(_train, 1, variant, 1, 1, 1, True)[0]
    return _references[variant]


LAYOUTS = {  # name: variant, tp, pp, ep, world, distributed optimizer
    "tp2": ("stem", 2, 1, 1, 2, True),
    "pp2": ("stem", 1, 2, 1, 2, True),
    "dp2": ("stem", 1, 1, 1, 2, False),
    "dp2_distributed_optimizer": ("stem", 1, 1, 1, 2, True),
    "tp2_pp2": ("stem", 2, 2, 1, 4, True),
    "hash_moe_ep2": ("hash_moe", 1, 1, 2, 2, False),
    "hash_moe_pp2_ep2": ("hash_moe", 1, 2, 2, 4, True),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_process(layout):
    variant, tp, pp, ep, world, dist_opt = LAYOUTS[layout]
    reference = _reference(variant)
    assert len(reference["losses"]) == STEPS and reference["losses"][-1] < reference["losses"][0]
    results = distributed.run(_train, world, variant, tp, pp, ep, dist_opt, reference, tp=tp, pp=pp, ep=ep)
    for rank, errors in enumerate(results):
        assert errors["loss"] < 1e-5, f"{layout} rank {rank}: losses differ by {errors['loss']}"
        assert errors["weights"] < 2e-5, (
            f"{layout} rank {rank}: weights after {STEPS} steps differ by {errors['weights']}"
        )
        if "grads" in errors:
            assert errors["grads"] < 1e-5, f"{layout} rank {rank}: step-1 gradients differ by {errors['grads']}"
