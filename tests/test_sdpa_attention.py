"""``SDPAttention`` (``model/sdpa_attention.py``) against megatron-core's ``DotProductAttention``, which
the local layer spec used before: the module's output and q, k, v gradients, and a whole model's losses and weight
gradients, equal within 1e-5 in fp32 for causal attention, the cross-document mask of ``data.reset_attention_mask``,
GQA, TP=2 (heads split over the ranks) and PP=2; the model built by ``build_gpt`` without TE uses it in every layer.

Each megatron world (one process, TP=2, PP=2) is spawned once (``distributed.run``) and computes all its cases.
"""

import dataclasses

import distributed
import pytest
import torch

from stem_megatron.config import HashMoEConfig, ModelConfig, ParallelConfig, STEMConfig

V, S, B, EOD, TOL = 64, 16, 3, 0, 1e-5
MODEL = ModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=V,
                    seq_length=S, init_method_std=0.2)  # larger than the default: attention far from uniform
GQA = dataclasses.replace(MODEL, num_query_groups=2)
STEM = STEMConfig(variant="stem", ratio="1/2")


# ------------------------------------------------------------------------------- in the spawned worlds
def _config(model=MODEL, tp=1, pp=1, **fields):
    from stem_megatron.model.gpt import transformer_config

    config = transformer_config(model, ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
                                on_gpu=False, stem=STEM)
    return dataclasses.replace(config, **fields) if fields else config


def _documents(b, seed=0):
    """Tokens ``[b, S+1]`` with EOD inside, and the bool mask ``[b, 1, S, S]`` (True = masked) and position ids that
    megatron's GPTDataset (``data/datasets.py``) builds for them with reset_attention_mask and reset_position_ids."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    tokens = torch.randint(1, V, (b, S + 1), generator=torch.Generator().manual_seed(seed))
    tokens[0, [4, 10]] = EOD
    tokens[1, 7] = EOD  # later samples have no EOD: plain causal
    built = [_get_ltor_masks_and_position_ids(t[:-1], EOD, True, True, False, True) for t in tokens]
    return tokens, torch.stack([m for m, _, _ in built]), torch.stack([p for _, _, p in built])


def _reference(q, k, v, mask, scale):
    """Attention over all heads in plain torch, ``[s, b, n, h] -> [s, b, n*h]`` (``mask``: True = masked)."""
    k, v = (t.repeat_interleave(q.size(2) // t.size(2), dim=2) for t in (k, v))
    scores = torch.einsum("qbnh,kbnh->bnqk", q, k) * scale
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1) if mask is not None else scores.softmax(-1)
    return torch.einsum("bnqk,kbnh->qbnh", probs, v).flatten(2)


def _module_errors(config, mask_type, mask=None, sq=S, layer_number=1, softmax_scale=None):
    """Max |SDPAttention - DotProductAttention| of the output and the q, k, v gradients on this TP rank's heads of
    the same full inputs, and of the output against ``_reference`` on all heads (this rank's slice)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from stem_megatron.model.sdpa_attention import SDPAttention

    args = dict(config=config, layer_number=layer_number, attn_mask_type=mask_type, attention_type="self",
                softmax_scale=softmax_scale)
    sdpa, dpa = SDPAttention(**args), DotProductAttention(**args)
    rank, heads, groups = (parallel_state.get_tensor_model_parallel_rank(), sdpa.num_attention_heads_per_partition,
                           sdpa.num_query_groups_per_partition)
    g = torch.Generator().manual_seed(1)
    hn = config.kv_channels
    q0 = torch.randn(sq, B, config.num_attention_heads, hn, generator=g)
    k0, v0 = (torch.randn(S, B, config.num_query_groups, hn, generator=g) for _ in range(2))
    dy = torch.randn(sq, B, heads * hn, generator=g)
    local = [q0[:, :, rank * heads:(rank + 1) * heads]] + [t[:, :, rank * groups:(rank + 1) * groups] for t in (k0, v0)]
    results = []
    for module in (sdpa, dpa):
        q, k, v = (t.clone().requires_grad_(True) for t in local)
        out = module(q, k, v, mask)
        (out * dy).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    errors = {what: (a - b).abs().max().item() for what, a, b in zip(("out", "q", "k", "v"), *results)}
    causal = mask_type == AttnMaskType.causal and sq > 1
    full_mask = torch.ones(S, S, dtype=torch.bool).triu(1) if causal and mask is None else mask
    ref = _reference(q0, k0, v0, full_mask, sdpa.softmax_scale)[..., rank * heads * hn:(rank + 1) * heads * hn]
    errors["reference"] = (results[0][0] - ref).abs().max().item()
    return errors


def _twins(model, config, mask_type):
    """This stage's GPT from ``build_gpt`` (SDPAttention) and the same spec with DotProductAttention, same weights."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from stem_megatron.layer_plan import planned_layers
    from stem_megatron.model.gpt import build_gpt
    from stem_megatron.model.specs import decoder_block_spec, device_rows, stem_mlp_spec, with_core_attention

    sdpa = build_gpt(model, STEM, config, attn_mask_type=mask_type)
    block = decoder_block_spec(config, planned_layers(model.num_layers, STEM), stem_mlp_spec("stem", V, device_rows()),
                               attn_mask_type=mask_type)
    block = dataclasses.replace(block, layer_specs=[with_core_attention(spec, DotProductAttention)
                                                    for spec in block.layer_specs])
    dpa = GPTModel(config=config, transformer_layer_spec=block, vocab_size=V, max_sequence_length=S,
                   pre_process=sdpa.pre_process, post_process=sdpa.post_process,
                   share_embeddings_and_output_weights=False, position_embedding_type="rope")
    dpa.load_state_dict(sdpa.state_dict())
    return sdpa, dpa


def _grad_errors(sdpa, dpa):
    grads = dict(dpa.named_parameters())
    assert all(p.grad is not None for p in grads.values())
    return max((p.grad - grads[name].grad).abs().max().item() for name, p in sdpa.named_parameters())


def _model_errors(model, tp, mask_type, documents):
    """Per-token losses and every weight gradient of the twins on one batch (with the document mask or none)."""
    from stem_megatron.model.token_context import token_ids

    sdpa, dpa = _twins(model, _config(model, tp), mask_type)
    tokens, mask, positions = _documents(B)
    if not documents:
        mask, positions = None, torch.arange(S).expand(B, S)
    losses = []
    for net in (sdpa, dpa):
        with token_ids(tokens[:, :-1], V):
            loss = net(tokens[:, :-1], positions, mask, labels=tokens[:, 1:])
        loss.mean().backward()
        losses.append(loss.detach())
    return {"loss": (losses[0] - losses[1]).abs().max().item(), "grads": _grad_errors(sdpa, dpa)}


def _dropout(module_cls, tp=1, p=0.25, seed=5):
    """Training-mode output of 8 keys with uniform probabilities (q = 0) and the identity as V (head dim 8), so each
    output entry is one probability, dropped or kept; the eval-mode output; whether the call moved torch's default
    generator and megatron's RNG tracker."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.enums import AttnMaskType

    module = module_cls(config=_config(tp=tp, attention_dropout=p), layer_number=1,
                        attn_mask_type=AttnMaskType.arbitrary, attention_type="self")
    heads = MODEL.num_attention_heads // tp
    q, k = torch.zeros(S, 8, heads, 8), torch.zeros(8, 8, heads, 8)
    v = torch.eye(8)[:, None, None, :].expand(8, 8, heads, 8).contiguous()
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    default, states = torch.get_rng_state(), tracker.get_states()
    with torch.no_grad():
        train = module(q, k, v, None)
        moved = {"default": not torch.equal(default, torch.get_rng_state()),
                 "tracker": any(not torch.equal(state, tracker.get_states()[name]) for name, state in states.items())}
        return train, module.eval()(q, k, v, None), moved


def _refused(config=None, mask_type=None, sk=S, mask=None, **kwargs):
    """The error SDPAttention raises (construction or forward), None if it raises none."""
    from megatron.core.transformer.enums import AttnMaskType

    from stem_megatron.model.sdpa_attention import SDPAttention

    try:
        module = SDPAttention(config=config or _config(), layer_number=1,
                              attn_mask_type=mask_type or AttnMaskType.causal, attention_type="self")
        q, kv = torch.zeros(S, B, 4, 8), torch.zeros(sk, B, 4, 8)
        module(q, kv, kv, mask, **kwargs)
    except (NotImplementedError, ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _layer_kinds(model):
    return [(type(layer.mlp).__name__, type(layer.self_attention.core_attention).__name__)
            for layer in model.decoder.layers]


def _single_process():
    import te_stand_ins
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from stem_megatron.layer_plan import planned_layers
    from stem_megatron.model import sdpa_attention
    from stem_megatron.model.gpt import build_gpt, transformer_config
    from stem_megatron.model.sdpa_attention import SDPAttention
    from stem_megatron.model.specs import decoder_block_spec

    causal, arbitrary = AttnMaskType.causal, AttnMaskType.arbitrary
    _, mask, _ = _documents(B)
    out = {"module": {
        "causal": _module_errors(_config(), causal),
        "documents": _module_errors(_config(), arbitrary, mask),
        "documents_mask_under_causal_type": _module_errors(_config(), causal, mask),
        "gqa_causal": _module_errors(_config(GQA), causal),
        "gqa_documents": _module_errors(_config(GQA), arbitrary, mask),
        "decode_one_query": _module_errors(_config(), causal, sq=1),
        "query_key_layer_scaling": _module_errors(_config(apply_query_key_layer_scaling=True), causal, layer_number=3),
        "softmax_scale": _module_errors(_config(), causal, softmax_scale=0.3),
    }}
    grouped = sdpa_attention._kernel_takes_grouped_kv
    sdpa_attention._kernel_takes_grouped_kv = lambda query, attn_mask: True  # as for bf16 on a GPU: enable_gqa
    out["module"]["gqa_causal_enable_gqa"] = _module_errors(_config(GQA), causal)
    sdpa_attention._kernel_takes_grouped_kv = grouped
    out["model"] = {"causal": _model_errors(MODEL, 1, causal, False),
                    "documents": _model_errors(MODEL, 1, arbitrary, True),
                    "gqa_documents": _model_errors(GQA, 1, arbitrary, True)}
    out["dropout"] = {"sdpa": _dropout(SDPAttention), "sdpa_again": _dropout(SDPAttention),
                      "sdpa_other_seed": _dropout(SDPAttention, seed=6), "dpa": _dropout(DotProductAttention)}
    out["refused"] = {
        "context parallelism": _refused(_config(context_parallel_size=2)),
        "softmax offset": _refused(_config(softmax_type="off-by-one")),
        "sliding window": _refused(_config(window_size=(4, 0))),
        "attention bias": _refused(attention_bias=torch.zeros(B, 4, S, S)),
        "packed sequences": _refused(packed_seq_params=PackedSeqParams(qkv_format="thd")),
        "causal over unequal lengths": _refused(sk=2 * S),
        "non-bool mask": _refused(mask_type=arbitrary, mask=mask.float()),
    }
    layers = {"stem": _layer_kinds(build_gpt(MODEL, STEM, _config()))}
    # MoE layers (Hash-MoE's): megatron's MoE layer spec on the planned layers, through decoder_block_spec
    moe = STEMConfig(variant="hash_moe", ratio="1/2")
    config = transformer_config(MODEL, ParallelConfig(), on_gpu=False, stem=moe,
                                hash_moe=HashMoEConfig(num_experts=4, expert_ffn_hidden_size=32))
    block = decoder_block_spec(config, planned_layers(MODEL.num_layers, moe), get_moe_module_spec(False, 4))
    layers["moe"] = _layer_kinds(GPTModel(config=config, transformer_layer_spec=block, vocab_size=V,
                                          max_sequence_length=S, position_embedding_type="rope"))
    te_stand_ins.install()  # TE's classes as stand-ins: the TE spec's attention slot holds DotProductAttention
    layers["stem_te"] = _layer_kinds(build_gpt(MODEL, STEM, _config(), use_te=True))
    out["layers"] = layers
    return out


def _tensor_parallel():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from stem_megatron.model.sdpa_attention import SDPAttention

    causal, arbitrary = AttnMaskType.causal, AttnMaskType.arbitrary
    _, mask, _ = _documents(B)
    return {
        "module": {"causal": _module_errors(_config(tp=2), causal),
                   "documents": _module_errors(_config(tp=2), arbitrary, mask),
                   "gqa_causal": _module_errors(_config(GQA, tp=2), causal),
                   "gqa_documents": _module_errors(_config(GQA, tp=2), arbitrary, mask)},
        "model": {"causal": _model_errors(MODEL, 2, causal, False),
                  "gqa_documents": _model_errors(GQA, 2, arbitrary, True)},
        "dropout": {"sdpa": _dropout(SDPAttention, tp=2)[0], "dpa": _dropout(DotProductAttention, tp=2)[0]},
    }


def _pipeline():
    from megatron.core.transformer.enums import AttnMaskType

    from stem_megatron.training.step import forward_backward

    out = {}
    for name, mask_type in (("causal", AttnMaskType.causal), ("documents", AttnMaskType.arbitrary)):
        sdpa, dpa = _twins(MODEL, _config(pp=2), mask_type)
        tokens, mask, positions = _documents(2 * B)
        batches = [{"tokens": tokens[i:i + B, :-1], "labels": tokens[i:i + B, 1:]} for i in (0, B)]
        if name == "documents":
            for i, batch in zip((0, B), batches):
                batch.update(attention_mask=mask[i:i + B], position_ids=positions[i:i + B])
        losses = [forward_backward(net, iter(batches), 2, B, S, V) for net in (sdpa, dpa)]
        out[name] = {"loss": abs(losses[0] - losses[1]), "grads": _grad_errors(sdpa, dpa)}
    return out


# ----------------------------------------------------------------------------------------------- tests
_worlds: dict = {}


def _world(name):
    """Results of one spawned world, by rank (each world runs once per test session)."""
    if name not in _worlds:
        fn, world, layout = {"single": (_single_process, 1, {}), "tp2": (_tensor_parallel, 2, {"tp": 2}),
                             "pp2": (_pipeline, 2, {"pp": 2})}[name]
        _worlds[name] = distributed.run(fn, world, **layout)
    return _worlds[name]


def _assert_within(errors, where):
    for what, err in errors.items():
        assert err < TOL, f"{where}: {what} differs by {err}"


@pytest.mark.parametrize("case", ["causal", "documents", "documents_mask_under_causal_type", "gqa_causal",
                                  "gqa_documents", "gqa_causal_enable_gqa", "decode_one_query",
                                  "query_key_layer_scaling", "softmax_scale"])
def test_module_equals_dot_product_attention(case):
    """Output and q, k, v gradients equal DotProductAttention's (and the output a plain-torch softmax attention):
    causal (SDPA's is_causal), the cross-document mask of megatron's GPTDataset under the arbitrary and the causal
    mask type (a given mask wins, as there), GQA 4 heads / 2 groups with K/V repeated and with enable_gqa, one query
    over 16 cached keys (decoding), apply_query_key_layer_scaling at layer 3, an explicit softmax scale."""
    _assert_within(_world("single")[0]["module"][case], case)


@pytest.mark.parametrize("case", ["causal", "documents", "gqa_documents"])
def test_model_losses_and_weight_gradients_equal(case):
    """A 4-layer STEM GPT from build_gpt and its twin with DotProductAttention, same weights: per-token losses and
    every weight gradient."""
    _assert_within(_world("single")[0]["model"][case], case)


@pytest.mark.slow
def test_tensor_parallel_splits_heads_as_megatron():
    """TP=2: each rank's heads give DotProductAttention's output and gradients and their columns of the all-heads
    reference (MHA and GQA, causal and documents); the models' losses and weight gradients at TP=2; dropout is drawn
    from megatron's RNG tracker, whose TP ranks draw different masks, as DotProductAttention's."""
    ranks = _world("tp2")
    for rank, result in enumerate(ranks):
        for kind in ("module", "model"):
            for case, errors in result[kind].items():
                _assert_within(errors, f"TP=2 rank {rank} {kind} {case}")
    for module in ("sdpa", "dpa"):
        assert not torch.equal(ranks[0]["dropout"][module] == 0, ranks[1]["dropout"][module] == 0), module


@pytest.mark.slow
def test_pipeline_parallel_losses_equal():
    """PP=2 through megatron's pipeline schedule (two micro-batches): the losses and each stage's weight gradients
    of the SDPAttention model equal those of the DotProductAttention model, causal and with the document mask."""
    for rank, result in enumerate(_world("pp2")):
        for case, errors in result.items():
            _assert_within(errors, f"PP=2 rank {rank} {case}")


def test_dropout_is_applied_in_training_from_the_rng_tracker():
    """attention_dropout=0.25 in training: each probability (1/8) is kept, scaled to 1/6, or dropped, about 3/4 of
    them kept; none in eval mode; drawn under megatron's RNG tracker (torch's default generator untouched), the
    same mask from the same tracker seed, another from another seed. DotProductAttention's mask is not required to
    be the same: a GPU's SDPA kernel draws its own (on the CPU the math kernel happens to draw the same one), so only
    its keep rate and RNG use are compared."""
    results = _world("single")[0]["dropout"]
    (train, eval_, moved), (again, _, _) = results["sdpa"], results["sdpa_again"]
    assert torch.allclose(eval_, torch.full_like(eval_, 1 / 8))
    kept = train != 0
    assert torch.allclose(train[kept], torch.full_like(train[kept], 1 / 6))
    assert abs(kept.float().mean().item() - 0.75) < 0.03, kept.float().mean()
    assert moved == {"default": False, "tracker": True}
    assert torch.equal(train, again)
    assert not torch.equal(train, results["sdpa_other_seed"][0])
    dpa_train, _, dpa_moved = results["dpa"]
    assert abs((dpa_train != 0).float().mean().item() - 0.75) < 0.03 and dpa_moved == moved


def test_unsupported_features_are_refused():
    """What DotProductAttention runs and SDPAttention does not raises a clear error, never a silent difference."""
    refused = _world("single")[0]["refused"]
    expected = {"context parallelism": "context parallelism", "softmax offset": "softmax_type='off-by-one'",
                "sliding window": "sliding-window", "attention bias": "attention bias",
                "packed sequences": "packed sequences", "causal over unequal lengths": "as many queries as keys",
                "non-bool mask": "must be bool"}
    for case, fragment in expected.items():
        assert refused[case] is not None and fragment in refused[case], (case, refused[case])


def test_build_gpt_uses_sdpa_attention_in_every_layer_without_te():
    """build_gpt(use_te=False): every layer's core attention is SDPAttention, dense and STEM layers alike, and the MoE
    layers of a Hash-MoE config's block spec; with TE (stand-in classes) the TE spec's attention is kept."""
    layers = _world("single")[0]["layers"]
    for variant, replaced in (("stem", "STEMMLP"), ("moe", "MoELayer")):
        assert {mlp for mlp, _ in layers[variant]} == {"MLP", replaced}, layers[variant]
        assert all(attention == "SDPAttention" for _, attention in layers[variant]), layers[variant]
    assert all(attention == "DotProductAttention" for _, attention in layers["stem_te"]), layers["stem_te"]
