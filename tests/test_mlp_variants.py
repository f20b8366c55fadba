"""Each MLP variant equals the paper's formula in plain torch (outputs, input and weight gradients), TP=1 and TP=2."""

import distributed
import pytest
import torch
import torch.nn.functional as F

from stem_megatron.config import ModelConfig, ParallelConfig
from stem_megatron.model.gpt import transformer_config
from stem_megatron.model.sharding import tp_slice
from stem_megatron.model.specs import stem_mlp_spec
from stem_megatron.model.token_context import token_ids

V, D, D_FF, S, B = 50, 16, 24, 7, 3


def reference(variant, x, t, Wg, Wu, Wd, U):
    """Paper eqs. 1, 4, 5 and the gate-replacement ablation, with full (unsharded) weights."""
    if variant == "dense":
        return F.silu(x @ Wg.T) * (x @ Wu.T) @ Wd.T
    if variant == "stem":
        return (F.silu(x @ Wg.T) * U[t]) @ Wd.T
    if variant == "stem_dagger":
        return (F.silu(x @ Wg.T) * (x @ Wu.T + U[t])) @ Wd.T
    return (F.silu(U[t]) * (x @ Wu.T)) @ Wd.T  # stem_gate


def _build(variant, config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    # what megatron's TransformerLayer passes its mlp (megatron-core >= 0.17)
    layer_args = dict(config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups(), is_mtp_layer=False)
    if variant == "dense":
        mlp = get_gpt_layer_local_spec(normalization="RMSNorm").submodules.mlp  # MLP.as_mlp_submodule
        return mlp(**layer_args, ffn_hidden_size=D_FF), {"linear_fc1.weight": "Wgu", "linear_fc2.weight": "Wd"}
    return build_module(stem_mlp_spec(variant, V), **layer_args), {
        "W_g.weight": "Wg", "W_u.weight": "Wu", "W_d.weight": "Wd", "U_l.weight": "U"}


def _check_variants(tp):
    from megatron.core import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank()
    model_cfg = ModelConfig(hidden_size=D, ffn_hidden_size=D_FF, num_attention_heads=2, vocab_size=V)
    config = transformer_config(model_cfg, ParallelConfig(tensor_model_parallel_size=tp), on_gpu=False)
    g = torch.Generator().manual_seed(0)
    full = {"Wg": torch.randn(D_FF, D, generator=g) / D**0.5, "Wu": torch.randn(D_FF, D, generator=g) / D**0.5,
            "Wd": torch.randn(D, D_FF, generator=g) / D_FF**0.5, "U": torch.randn(V, D_FF, generator=g)}
    full["Wgu"] = torch.cat([full["Wg"], full["Wu"]])
    x0 = torch.randn(S, B, D, generator=g)
    t = torch.randint(0, V, (B, S), generator=g)
    t[1, :3] = t[0, 0]  # repeated ids: their row gradients must accumulate
    dy = torch.randn(S, B, D, generator=g)
    errors = {}
    for variant in ("dense", "stem", "stem_dagger", "stem_gate"):
        module, names = _build(variant, config)
        params = dict(module.named_parameters())
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(tp_slice(full[names[name]], p, rank, tp))
        x = x0.clone().requires_grad_(True)
        with token_ids(t, V):
            out, bias = module(x)
        assert bias is None
        (out * dy).sum().backward()

        ref = {k: v.clone().requires_grad_(True) for k, v in full.items() if k != "Wgu"}
        xr = x0.clone().requires_grad_(True)
        out_ref = reference(variant, xr, t.t(), ref["Wg"], ref["Wu"], ref["Wd"], ref["U"])
        (out_ref * dy).sum().backward()
        ref_grads = {k: v.grad if v.grad is not None else torch.zeros_like(v) for k, v in ref.items()}
        ref_grads["Wgu"] = torch.cat([ref_grads["Wg"], ref_grads["Wu"]])

        errors[variant] = {"out": (out - out_ref).abs().max().item(), "x": (x.grad - xr.grad).abs().max().item()}
        for name, p in params.items():
            assert p.grad is not None, f"{variant}: {name} got no gradient"
            errors[variant][name] = (p.grad - tp_slice(ref_grads[names[name]], p, rank, tp)).abs().max().item()
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_mlp_variants_match_paper_formulas(tp):
    for rank_errors in distributed.run(_check_variants, tp, tp, tp=tp):
        for variant, errs in rank_errors.items():
            for what, err in errs.items():
                assert err < 1e-5, f"TP={tp} {variant}: {what} differs from the plain-torch formula by {err}"
