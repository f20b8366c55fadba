"""``checkpoint.init_from_hf``: Hugging Face Llama and Qwen2 models as a run's initial weights (checkpoint/hf/).

Against transformers' own models (tests/hf_models.py: GQA, Qwen2's biases, tied embeddings, rope theta, eps, a padded
vocabulary, Llama 3's RoPE scaling): the same logits at TP=1 (DP=2) and at TP=2 x PP=2, within 1e-5 of the logits'
scale; a dense Llama imported at TP=2 x PP=2 then exported (``checkpoint.export`` and ``stem-export-hf``) gives back
its tensors bitwise, the Qwen2 exported so gives transformers' Qwen2 logits in our transformers model;
the dense-to-STEM conversion keeps the dense gate and down projections and, with ``from_dense``, fills ``U_l`` with
``W_u E[x_l | t]`` as a plain loop over the calibration windows computes it, bitwise the same at DP=2 and in one
process and whatever the pass's grouping of layers (its sums are fixed-point integers, which have no order); bad
input (a truncated shard, a shard the index names but the directory lacks, a NaN weight among them) is refused in one
line before any process group starts.
"""

import json
import math
import re
import shutil

import distributed
import pytest
import torch
from hf_models import ARCHS, import_config, save_hf_model
from safetensors.torch import load_file, save_file

BOUND = 1e-5
CALIBRATION = 1024  # tokens of the from_dense pass: 32 windows of 32


@pytest.fixture(scope="module")
def hf_dirs(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_models")
    return {arch: save_hf_model(arch, corpus, root / arch) for arch in ARCHS}


def _logits(trainer, tokens: torch.Tensor):
    """The model's logits [b, s, V] for ``tokens`` on the last pipeline stage (gathered over TP), None elsewhere;
    through megatron's schedule, as validation runs it."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from stem_megatron.model.token_context import token_ids

    out = []

    def forward_step(data, model):
        batch = next(data)
        positions = torch.arange(batch.shape[1]).expand_as(batch)
        with token_ids(batch, None, None):
            output = model(batch, positions, None)

        def keep(logits):
            out.append(gather_from_tensor_model_parallel_region(logits))
            return logits.sum() * 0, {}
        return output, keep

    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]), model=[trainer.model],
                                    num_microbatches=1, seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0],
                                    forward_only=True)
    return out[0] if out else None


def _import(cfg, world: int):
    """The run's start as the training loop makes it: checks, model, then the checkpointer's resume (a new run: the
    Hugging Face weights)."""
    from stem_megatron.checkpoint.hf.model_config import check_hf_import
    from stem_megatron.config import validate
    from stem_megatron.training.components.checkpointer import Checkpointer
    from stem_megatron.training.setup import setup_model

    validate(cfg, world)
    check_hf_import(cfg)
    trainer = setup_model(cfg)
    assert Checkpointer(cfg, trainer, detector=None).resume() == 0
    return trainer


def _dense_at_layout(corpus, hf_dirs, tokens, tp, pp, export_dir):
    """Per architecture the imported model's logits; the Llama exported to ``export_dir`` (when given)."""
    from stem_megatron.export.writer import export

    got = {}
    for arch, hf_dir in hf_dirs.items():
        cfg = import_config(arch, corpus, hf_dir, tp, pp)
        trainer = _import(cfg, torch.distributed.get_world_size())
        got[arch] = _logits(trainer, tokens)
        if export_dir is not None:
            export(cfg, trainer, export_dir / arch)
    return got


def _reference(hf_dir, tokens):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(hf_dir).eval()(input_ids=tokens).logits


def _at_dp2(corpus, hf_dirs, tokens):
    """TP=1, DP=2: both models' logits, then the Llama as STEM-1/3 with ``from_dense`` host tables."""
    return {"logits": _dense_at_layout(corpus, hf_dirs, tokens, 1, 1, None),
            "converted": _converted(corpus, hf_dirs["llama"], "host")}


def _in_one_process(corpus, llama, exports, out, huge):
    """One process: the TP=2 x PP=2 exports to Hugging Face, the Llama as STEM-1/3 with a ``from_dense`` device
    table, the calibration's means of layers 1-3 in groups of one layer and in one group, and the calibration of
    ``huge`` (a Llama whose layer 1 has FFN inputs too large for the sums) refused."""
    from stem_megatron.checkpoint.hf.calibration import mean_ffn_inputs
    from stem_megatron.config import ConfigError
    from stem_megatron.export.hf.writer import export_hf

    for export in sorted(exports.iterdir()):
        export_hf(export, out / export.name)
    cfg = import_config("llama", corpus, llama, variant="stem", ratio="full", table_init="from_dense",
                        calibration_tokens=CALIBRATION)
    grouped = {}
    for gib in (1e-9, 1.0):  # below one layer's sums (400 x 64 int64): a group a layer; every layer in one group
        cfg.stem.calibration_gib = gib
        grouped[gib] = list(mean_ffn_inputs(cfg, llama, [1, 2, 3], cfg.model.vocab_size, torch.device("cpu")))
    with pytest.raises(ConfigError) as refusal:
        next(mean_ffn_inputs(cfg, huge, [1], cfg.model.vocab_size, torch.device("cpu")))
    return {"device": _converted(corpus, llama, "device"), "grouped": grouped, "refusal": str(refusal.value)}


@pytest.fixture(scope="module")
def imported(corpus, hf_dirs, tmp_path_factory):
    """The module's three worlds (each a process launch), which both slow tests read: DP=2, TP=2 x PP=2, one
    process."""
    tmp = tmp_path_factory.mktemp("imported")
    tokens = torch.randint(0, 400, (2, 32), generator=torch.Generator().manual_seed(0))
    huge = tmp / "huge"  # layer 1's FFN inputs up to 4e10: sums of a token seen over 6 times could overflow
    shutil.copytree(hf_dirs["llama"], huge)
    weights = load_file(huge / "model.safetensors")
    weights["model.layers.1.post_attention_layernorm.weight"] *= 1e10
    save_file(weights, huge / "model.safetensors", metadata={"format": "pt"})
    at_dp2 = distributed.run(_at_dp2, 2, corpus, hf_dirs, tokens)
    at_tp2_pp2 = distributed.run(_dense_at_layout, 4, corpus, hf_dirs, tokens, 2, 2, tmp / "export", tp=2, pp=2)
    (one,) = distributed.run(_in_one_process, 1, corpus, hf_dirs["llama"], tmp / "export", tmp / "hf", huge)
    return {"tokens": tokens, "tp1": [r["logits"] for r in at_dp2], "tp2_pp2": at_tp2_pp2, "hf": tmp / "hf",
            "host": at_dp2[0]["converted"], **one}


@pytest.mark.slow
def test_imported_models_give_transformers_logits_at_tp1_and_tp2_pp2(hf_dirs, imported):
    tokens, at_tp1, at_tp2_pp2 = imported["tokens"], imported["tp1"], imported["tp2_pp2"]
    for arch, hf_dir in hf_dirs.items():
        ref = _reference(hf_dir, tokens)
        vocab = ARCHS[arch]["vocab_size"]
        scale = ref.abs().max()
        for name, results in (("tp1", at_tp1), ("tp2_pp2", at_tp2_pp2)):
            last = [r[arch] for r in results if r[arch] is not None]
            assert len(last) == len(results) // (2 if name == "tp2_pp2" else 1)  # the last stage's ranks
            for ours in last:
                assert ours.shape[-1] >= vocab
                err = (ours[..., :vocab] - ref).abs().max() / scale
                assert err <= BOUND, (arch, name, float(err))
    _exported_tensors_are_the_imported_ones(hf_dirs["llama"], imported["hf"] / "llama")
    _exported_qwen2_gives_transformers_logits(hf_dirs["qwen2"], imported["hf"] / "qwen2", tokens)


def _exported_tensors_are_the_imported_ones(hf_dir, back_dir) -> None:
    """The Llama imported at TP=2 x PP=2 and exported: every tensor of the HF directory back, bitwise."""
    from safetensors.torch import load_file

    original = load_file(hf_dir / "model.safetensors")
    back = {}
    for shard in sorted(back_dir.glob("*.safetensors")):
        back.update(load_file(shard))
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    config = json.loads((back_dir / "config.json").read_text())
    assert (config["rope_theta"], config["rope_scaling_factor"], config["rms_norm_eps"]) == (50000.0, 8.0, 1e-6)
    assert json.loads((back_dir / "tokenizer_config.json").read_text())["padding_side"] == "left"


def _exported_qwen2_gives_transformers_logits(hf_dir, back_dir, tokens) -> None:
    """The Qwen2 imported at TP=2 x PP=2 and exported: our transformers model (its q/k/v biases, the tied head as a
    copy, the padded id) gives Qwen2's logits."""
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(back_dir, trust_remote_code=True).eval()(input_ids=tokens).logits
    ref = _reference(hf_dir, tokens)
    assert ours.shape[-1] == ARCHS["qwen2"]["vocab_size"] + 1  # padded for TP=2
    assert (ours[..., :-1] - ref).abs().max() <= BOUND * ref.abs().max()


def _converted(corpus, hf_dir, placement):
    """A dense Llama imported as STEM-1/3 (its layer 3 of 4, by the plan) with ``from_dense`` tables: the tables and the
    STEM layers' dense weights."""
    from stem_megatron.config import HostTablesConfig

    cfg = import_config("llama", corpus, hf_dir, variant="stem", ratio="1/3", table_init="from_dense",
                        calibration_tokens=CALIBRATION)
    cfg.host_tables = HostTablesConfig(placement=placement)
    trainer = _import(cfg, torch.distributed.get_world_size())
    stage = trainer.model.module
    weights = {n: p.detach().clone() for n, p in stage.named_parameters() if ".mlp." in n and "U_l" not in n}
    if trainer.tables.hosted:
        tables = {layer - 1: trainer.tables.table(layer) for layer in trainer.tables.layers}
    else:
        tables = {int(n.split(".")[2]): p.detach().clone() for n, p in stage.named_parameters() if "U_l" in n}
    return {"tables": tables, "weights": weights}


def _plain_from_dense(corpus, hf_dir, layers):
    """``W_u E[x_l | t]`` by a loop over the calibration windows and their positions (unseen ids: ``W_u E[x_l]``)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    data = IndexedDataset(str(corpus / "train"))
    stream = torch.cat([torch.from_numpy(data[i].astype("int64")) for i in range(len(data))])[:CALIBRATION]
    seen = {layer: {} for layer in layers}
    inputs = {}
    hooks = [model.model.layers[layer].mlp.register_forward_pre_hook(
        lambda _m, args, layer=layer: inputs.__setitem__(layer, args[0][0])) for layer in layers]
    with torch.no_grad():
        for window in stream.view(-1, 32):
            model(input_ids=window[None])
            for layer in layers:
                for pos, t in enumerate(window.tolist()):
                    seen[layer].setdefault(t, []).append(inputs[layer][pos].double())
    for hook in hooks:
        hook.remove()
    tables = {}
    for layer in layers:
        every = torch.stack([x for xs in seen[layer].values() for x in xs]).mean(0)
        means = torch.stack([torch.stack(seen[layer][t]).mean(0) if t in seen[layer] else every for t in range(400)])
        tables[layer] = means.float() @ model.model.layers[layer].mlp.up_proj.weight.t()
    return tables, {layer: model.model.layers[layer].mlp for layer in layers}


@pytest.mark.slow
def test_a_dense_model_becomes_stem_with_tables_from_dense(corpus, hf_dirs, imported):
    """Host tables at DP=2 (the calibration windows split over the ranks, the sums all-reduced) and a device table
    in one process give the plain loop's tables, bitwise the same; ``W_g``/``W_d`` are the dense gate and down
    projections."""
    host, device = imported["host"], imported["device"]
    want, mlps = _plain_from_dense(corpus, hf_dirs["llama"], sorted(host["tables"]))
    assert sorted(host["tables"]) == sorted(device["tables"]) == [3]  # STEM-1/3 of 4 layers: the plan's layer
    assert torch.equal(host["tables"][3], device["tables"][3])
    for got in (host, device):
        for layer, table in want.items():
            assert (got["tables"][layer] - table).abs().max() <= BOUND * table.abs().max(), layer
            assert torch.equal(got["weights"][f"decoder.layers.{layer}.mlp.W_g.weight"], mlps[layer].gate_proj.weight)
            assert torch.equal(got["weights"][f"decoder.layers.{layer}.mlp.W_d.weight"], mlps[layer].down_proj.weight)


@pytest.mark.slow
def test_the_calibration_in_groups_of_layers_gives_the_same_means(imported):
    """A budget below one layer's sums: a pass a layer, each stopping at its layer; the means bitwise those of one
    pass over every layer."""
    apart, together = imported["grouped"][1e-9], imported["grouped"][1.0]
    assert [sorted(group) for group in apart] == [[1], [2], [3]] and [sorted(g) for g in together] == [[1, 2, 3]]
    for group in apart:
        for layer, means in group.items():
            assert torch.equal(means, together[0][layer]), layer


def test_calibration_sums_have_no_order():
    """FFN inputs by token id that cancel, pairs of x and -x of 2^20..2^30 beside inputs of 2^-20..2^-10 (fp64 sums of
    them depend on their order): summed in two orders and split over two ranks as DP=2 splits the windows (then
    added, as the all-reduce does), the means are bitwise the same, within the fixed point's half unit (and fp32's
    rounding) of the exact means; unseen ids get the mean of all."""
    from stem_megatron.checkpoint.hf.calibration import SHIFT, fixed_point, means_of

    g = torch.Generator().manual_seed(0)
    vocab, d, n = 16, 8, 512

    def inputs(low, high, rows):
        sign = torch.randint(0, 2, (rows, d), generator=g) * 2 - 1
        return sign * (torch.rand(rows, d, generator=g) + 1) * 2.0 ** torch.randint(low, high, (rows, d), generator=g)

    big = inputs(20, 31, n // 4)
    x = torch.cat([torch.stack([big, -big], 1).reshape(n // 2, d), inputs(-20, -9, n // 2)])
    ids = torch.cat([torch.randint(0, vocab - 2, (n // 4,), generator=g).repeat_interleave(2),
                     torch.randint(0, vocab - 2, (n // 2,), generator=g)])  # ids 14 and 15 never seen

    def means(*ranks):
        sums, counts = torch.zeros(vocab, d, dtype=torch.int64), torch.zeros(vocab, dtype=torch.int64)
        for rows in ranks:
            sums += torch.zeros_like(sums).index_add_(0, ids[rows], fixed_point(x[rows]))
            counts += torch.bincount(ids[rows], minlength=vocab)
        return means_of(sums, counts)

    got = means(torch.arange(n))
    assert torch.equal(means(torch.randperm(n, generator=g)), got)
    assert torch.equal(means(torch.arange(0, n, 2), torch.arange(1, n, 2)), got)
    exact = torch.zeros(vocab, d, dtype=torch.float64)
    for t in range(vocab):
        rows = x[ids == t] if t < vocab - 2 else x
        exact[t] = torch.tensor([math.fsum(column) / len(column) for column in rows.double().t().tolist()])
    assert ((got - exact).abs() <= 2.0 ** -(SHIFT + 1) + exact.abs() * 2.0 ** -24).all()


def test_calibration_sums_that_could_overflow_are_refused_in_one_line(imported):
    """A token seen ``count`` times with inputs up to ``amax``: sums up to ``amax * count * 2^24``, refused from 2^62
    (or a NaN), in the pass (``huge``: a Llama with layer 1's FFN inputs up to 4e10) as in the bound alone."""
    from stem_megatron.checkpoint.hf.calibration import check_range
    from stem_megatron.config import ConfigError

    check_range(3, 1.0, 2 ** 38 - 1)
    for amax, count in ((1.0, 2 ** 38), (2.0 ** 20, 2 ** 18), (float("nan"), 1)):
        with pytest.raises(ConfigError):
            check_range(3, amax, count)
    said = imported["refusal"]
    assert "\n" not in said
    assert re.fullmatch(r"stem\.calibration_tokens: model\.layers\.1's FFN inputs reach \|x\|=\S+ and a token "
                        r"occurs \d+ times in the calibration pass, so its fixed-point sums \(x \* 2\^24\) could pass "
                        r"2\^62: set fewer stem\.calibration_tokens, so that no token occurs more than [1-9]\d* times",
                        said), said


def _errors(corpus, hf_dirs, tmp_path):
    from stem_megatron.checkpoint.hf.model_config import check_hf_import
    from stem_megatron.config import ConfigError, validate

    said = {}
    llama = hf_dirs["llama"]

    def refusal(name, cfg):
        validate(cfg, 1)
        with pytest.raises(ConfigError) as error:
            check_hf_import(cfg)
        said[name] = str(error.value)

    refusal("not a model", import_config("llama", corpus, tmp_path))
    foreign = tmp_path / "gpt2"
    shutil.copytree(llama, foreign)
    config = json.loads((foreign / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    refusal("architecture", import_config("llama", corpus, foreign))
    wrong = import_config("llama", corpus, llama)
    wrong.model.hidden_size = 128
    refusal("shape", wrong)
    big = tmp_path / "small_vocab"
    shutil.copytree(llama, big)
    (big / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    cfg = import_config("llama", corpus, big)
    cfg.model.vocab_size = 300
    cfg.data.vocab_size = 300
    refusal("tokenizer", cfg)
    refusal("hash_moe", import_config("llama", corpus, llama, variant="hash_moe"))
    weights = load_file(llama / "model.safetensors")
    nan = tmp_path / "nan"
    shutil.copytree(llama, nan)
    weights["model.layers.2.mlp.up_proj.weight"][5, 7] = float("nan")
    save_file(weights, nan / "model.safetensors", metadata={"format": "pt"})
    refusal("nan", import_config("llama", corpus, nan))
    truncated = tmp_path / "truncated"
    shutil.copytree(llama, truncated)
    with open(truncated / "model.safetensors", "r+b") as file:
        file.truncate((truncated / "model.safetensors").stat().st_size - 1000)
    refusal("truncated", import_config("llama", corpus, truncated))
    sharded = tmp_path / "sharded"
    shutil.copytree(llama, sharded)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    index = {name: f"model-0000{1 + name.startswith('model.layers.3')}-of-00002.safetensors" for name in weights}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    refusal("missing shard", import_config("llama", corpus, sharded))
    return said


def test_bad_input_is_one_line(corpus, hf_dirs, tmp_path):
    said = _errors(corpus, hf_dirs, tmp_path)
    for line in said.values():
        assert "\n" not in line and line.startswith("checkpoint.init_from_hf: "), line
    assert "is not a Hugging Face model directory (no config.json)" in said["not a model"]
    assert "holds a GPT2LMHeadModel: the import takes LlamaForCausalLM, Qwen2ForCausalLM" in said["architecture"]
    assert "has hidden_size=64 where the run has model.hidden_size=128: set" in said["shape"]
    assert "model.hidden_size=64 model.ffn_hidden_size=96" in said["shape"]
    assert "Hash-MoE's experts have no weights in it: import it as dense or as a STEM variant" in said["hash_moe"]
    assert re.search(r"has a tokenizer of 3\d\d ids, more than the model's vocab_size=300: ", said["tokenizer"])
    assert said["nan"].endswith("nan has a non-finite weight (NaN or inf) in model.layers.2.mlp.up_proj.weight "
                                "(model.safetensors): a damaged or diverged save; import a healthy one")
    assert re.search(r"truncated has a shard model\.safetensors that does not read \(safetensors: .*\): truncated or "
                     r"damaged; download or save it again$", said["truncated"]), said["truncated"]
    assert said["missing shard"].endswith("has a model.safetensors.index.json naming 1 shard(s) it lacks "
                                          "(model-00002-of-00002.safetensors): an incomplete download; fetch the "
                                          "missing files")
