"""``host_tables.clip``: with ``separate`` the host tables' gradients are clipped by their own norm and the dense
gradients by theirs (the released code, docs/recipes.md); with ``global`` both by their joint norm.

Each case trains one step from the same weights and batch twice: unclipped (``train.clip_grad=0``, the
reference) and clipped. The gradients megatron's Adam (dense) and DeepSpeed's CPU Adam (table rows) receive
must be the reference's times the clip coefficient a plain computation gives from the reference's norms."""

import distributed
import pytest
import torch

from stem_megatron.config import HostTablesConfig, ModelConfig, RunConfig, STEMConfig, TrainConfig

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=32,
                    seq_length=16)
MICRO = 2


def _cfg(clip, clip_grad):
    cfg = RunConfig(model=MODEL, stem=STEMConfig(variant="stem", ratio="1/2"),
                    host_tables=HostTablesConfig(optimizer="lazy", clip=clip),
                    train=TrainConfig(steps=4, micro_batch_size=MICRO, global_batch_size=2 * MICRO,
                                      clip_grad=clip_grad))
    cfg.data.vocab_size = MODEL.vocab_size
    return cfg


def _one_step(cfg, weights, boost):
    """One step; returns the step record, the dense grads megatron's Adam gets and the row grads CPU Adam
    gets. ``boost`` multiplies the gradient reaching the table rows (a hook on each micro-batch's row leaf as the
    store tracks it), so the tables' norm can exceed the dense one; the dense gradients do not depend on it."""
    from megatron.core import parallel_state
    from stem_megatron.training.setup import setup_model
    from stem_megatron.training.step import train_step

    trainer = setup_model(cfg)
    with torch.no_grad():
        for name, p in trainer.model.module.named_parameters():  # the first call's dense weights for all
            if name in weights:
                p.copy_(weights[name])
            else:
                weights[name] = p.detach().clone()
    rows_of = trainer.tables.rows

    def boosted(layer, prefetched):
        leaf = rows_of(layer, prefetched)
        leaf.register_hook(lambda grad: grad * boost)  # before the gradient accumulates into the leaf
        return leaf

    trainer.tables.rows = boosted
    dense, rows = [], []
    optimizer, adam = trainer.optimizer, trainer.tables.optimizer.adam
    step_with_ready_grads, update_rows = optimizer.step_with_ready_grads, adam.update_rows

    def capture_dense():
        dense.extend(p.grad.detach().clone() for p in optimizer.get_parameters() if p.grad is not None)
        return step_with_ready_grads()

    def capture_rows(step, lr, ids, grads, *args, grad_rows=None):
        rows.append((grads if grad_rows is None else grads[grad_rows]).detach().clone())
        return update_rows(step, lr, ids, grads, *args, grad_rows=grad_rows)

    optimizer.step_with_ready_grads, adam.update_rows = capture_dense, capture_rows
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    n_micro = cfg.train.global_batch_size // (MICRO * dp)
    seqs = torch.randint(0, MODEL.vocab_size, (cfg.train.global_batch_size, MODEL.seq_length + 1),
                         generator=torch.Generator().manual_seed(5))
    batches = [seqs[(k * dp + dp_rank) * MICRO:(k * dp + dp_rank + 1) * MICRO] for k in range(n_micro)]
    with trainer.tables.stream(iter([{"tokens": s[:, :-1], "labels": s[:, 1:]} for s in batches]), n_micro) as data:
        record = train_step(trainer, data, n_micro, MICRO, MODEL.seq_length, MODEL.vocab_size)
    return record, dense, rows


def _clip_cases():
    """Per case (clip mode, which part exceeds the threshold): the largest relative error of the dense and
    the row gradients against the reference times the expected coefficient, and the coefficients."""
    out = {}
    for boost, exceeds in ((1.0, "dense"), (1.0e4, "stem")):
        weights = {}
        ref, ref_dense, ref_rows = _one_step(_cfg("global", 0.0), weights, boost)
        d, s = ref["dense_grad_norm"], ref["stem_grad_norm"]
        out[f"norms_{exceeds}"] = (d, s, ref["grad_norm"])
        clip = (d * s) ** 0.5  # between the two norms
        for mode in ("separate", "global"):
            record, dense, rows = _one_step(_cfg(mode, clip), weights, boost)
            if mode == "separate":
                dense_coef, stem_coef = min(1.0, clip / (d + 1e-6)), min(1.0, clip / (s + 1e-6))
            else:
                dense_coef = stem_coef = min(1.0, clip / ((d * d + s * s) ** 0.5 + 1e-6))

            def rel(got, want):
                return max((g - w).abs().max().item() / max(w.abs().max().item(), 1e-30) for g, w in zip(got, want))

            out[(mode, exceeds)] = {
                "dense_err": rel(dense, [g * dense_coef for g in ref_dense]),
                "rows_err": rel(rows, [g * stem_coef for g in ref_rows]),
                "counts": (len(dense), len(ref_dense), len(rows), len(ref_rows)),
                "coefs": (dense_coef, stem_coef),
                "norms": (record["dense_grad_norm"], record["stem_grad_norm"], record["grad_norm"]),
                "clip": clip,
            }
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world, tp", [(1, 1), (2, 2)], ids=["single", "tp2"])
def test_separate_clips_tables_and_dense_by_their_own_norms(world, tp):
    for rank, out in enumerate(distributed.run(_clip_cases, world, tp=tp)):
        d, s, joint = out["norms_dense"]
        assert d > s, "without the boost the dense norm should be the larger"
        assert out["norms_stem"][1] > out["norms_stem"][0], "the boost should make the tables' norm the larger"
        assert joint == pytest.approx((d * d + s * s) ** 0.5, rel=1e-9)
        for mode in ("separate", "global"):
            for exceeds in ("dense", "stem"):
                case = out[(mode, exceeds)]
                where = f"rank {rank} {mode}, {exceeds} norm above clip {case['clip']:.3g}"
                n_dense, n_ref_dense, n_rows, n_ref_rows = case["counts"]
                assert n_dense == n_ref_dense > 0 and n_rows == n_ref_rows > 0, where
                assert case["dense_err"] < 1e-5, f"{where}: dense grads off by {case['dense_err']:.2e}"
                assert case["rows_err"] < 1e-5, f"{where}: table row grads off by {case['rows_err']:.2e}"
                assert case["norms"] == pytest.approx(out[f"norms_{exceeds}"], rel=1e-6), where
                dense_coef, stem_coef = case["coefs"]
                if mode == "separate":  # only the part above the threshold is scaled
                    assert (dense_coef < 1.0) == (exceeds == "dense") and (stem_coef < 1.0) == (exceeds == "stem")
                else:
                    assert dense_coef == stem_coef < 1.0
