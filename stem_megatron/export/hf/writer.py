"""A Hugging Face directory from a stem-megatron export: what ``AutoModelForCausalLM.from_pretrained(dir,
trust_remote_code=True)`` loads (docs/checkpoints.md, "Hugging Face export").

    config.json                the StemConfig, with ``auto_map`` to the two files below
    configuration_stem.py      the model's configuration (configuration_stem.py here)
    modeling_stem.py           the model (modeling_stem.py here)
    model-0000k-of-0000n.safetensors, model.safetensors.index.json
                               the weights under transformers' Llama names; each STEM table ``U_l`` in a shard of
                               its own, so a loader can place the tables apart from the rest
    tokenizer.json, tokenizer_config.json, generation_config.json
                               the export's tokenizer, its end-of-document token as BOS/EOS/padding; the ids past
                               the tokenizer's in a padded vocabulary suppressed in generation, as stem-generate
                               never generates them

megatron's fused projections are split on the way (``tensors``, which the import reads with too):
``linear_qkv`` (per query group: its query heads, then one key and one value head; its biases alike) into ``q_proj``,
``k_proj``, ``v_proj``; ``linear_fc1`` ([gate; up]) into ``gate_proj`` and ``up_proj``. A STEM layer keeps the
paper's names: ``mlp.W_g``, ``mlp.W_u``, ``mlp.U_l``, ``mlp.W_d``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from stem_megatron.config import RunConfig
from stem_megatron.data.tokenizer import HFTokenizer
from stem_megatron.durable import fsync_dir
from stem_megatron.export.format import ExportError, read_export
from stem_megatron.export.hf.tensors import LAYER, PLAIN, TOP, split_fc1, split_qkv

MODEL_FILES = ("configuration_stem.py", "modeling_stem.py")
HERE = Path(__file__).resolve().parent
_STEM = ("mlp.W_g.weight", "mlp.W_u.weight", "mlp.W_d.weight", "mlp.U_l.weight")


def hf_weights(cfg: RunConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The export's single-process weights under the HF model's names (contiguous tensors)."""
    m = cfg.model
    heads = m.num_attention_heads
    groups = m.num_query_groups or heads
    out = {}
    for name, tensor in weights.items():
        if name in TOP:
            out[TOP[name]] = tensor
            continue
        match = LAYER.match(name)
        if match is None:
            raise ExportError(f"{name}: the Hugging Face format has no place for this weight")
        prefix, rest = f"model.layers.{match[1]}.", match[2]
        if rest in _STEM:
            out[prefix + rest] = tensor
        elif rest in PLAIN:
            out[prefix + PLAIN[rest]] = tensor
        elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = rest.rsplit(".", 1)[1]
            for proj, part in zip("qkv", split_qkv(tensor, heads, groups)):
                out[f"{prefix}self_attn.{proj}_proj.{kind}"] = part
        elif rest == "mlp.linear_fc1.weight":
            out[prefix + "mlp.gate_proj.weight"], out[prefix + "mlp.up_proj.weight"] = split_fc1(tensor)
        else:
            raise ExportError(f"{name}: the Hugging Face format has no place for this weight")
    return {name: tensor.contiguous() for name, tensor in out.items()}


def hf_config(cfg: RunConfig, weights: dict[str, torch.Tensor], eod: int) -> dict:
    m = cfg.model
    stem_layers = sorted(int(LAYER.match(n)[1]) for n in weights if n.endswith(".mlp.U_l.weight"))
    dtype = str(next(iter(weights.values())).dtype).removeprefix("torch.")
    return {"architectures": ["StemForCausalLM"], "model_type": "stem_megatron",
            "auto_map": {"AutoConfig": "configuration_stem.StemConfig",
                         "AutoModelForCausalLM": "modeling_stem.StemForCausalLM"},
            "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "intermediate_size": m.ffn_hidden_size,
            "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
            "num_key_value_heads": m.num_query_groups or m.num_attention_heads, "rms_norm_eps": m.norm_epsilon,
            "rope_theta": float(m.rotary_base), "rope_scaling_factor": m.rope_scaling_factor,
            "attention_bias": m.qkv_bias, "max_position_embeddings": m.seq_length,
            "stem_variant": cfg.stem.variant if stem_layers else "stem", "stem_layers": stem_layers,
            "stem_tables_on_host": False, "initializer_range": m.init_method_std, "use_cache": True,
            "bos_token_id": eod, "eos_token_id": eod, "pad_token_id": eod, "tie_word_embeddings": False,
            "dtype": dtype}


def _shards(weights: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """The weights in shards of at most ``max_bytes`` (a larger tensor alone), each STEM table alone."""
    shards, current, size = [], {}, 0
    for name, tensor in weights.items():
        if name.endswith(".U_l.weight"):
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = tensor, size + nbytes
    if current:
        shards.append(current)
    return shards + [{name: t} for name, t in weights.items() if name.endswith(".U_l.weight")]


def export_hf(export_dir, out_dir, max_shard_bytes: int = 2 * 2**30) -> Path:
    """Write the HF directory of ``export_dir`` to ``out_dir`` (atomically: a sibling, renamed when complete)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists():
        raise ExportError(f"{out} already exists: remove it or choose another --out")
    cfg, weights, tokenizer = read_export(export_dir)
    if cfg.stem.variant == "hash_moe":
        raise ExportError(f"{export_dir} is a Hash-MoE model, which the Hugging Face format does not hold (its "
                          "experts are routed by a token hash): export a dense or STEM model")
    if tokenizer is None:
        raise ExportError(f"{export_dir} has no tokenizer.json: export from a run whose data dir has one")
    tokens = HFTokenizer(tokenizer)
    eod = tokens.eod
    named = hf_weights(cfg, weights)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards = _shards(named, max_shard_bytes)
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(tmp / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in named.values())
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (tmp / "config.json").write_text(json.dumps(hf_config(cfg, weights, eod), indent=2))
    generation = {"bos_token_id": eod, "eos_token_id": eod, "pad_token_id": eod, "do_sample": False}
    if tokens.vocab_size < cfg.model.vocab_size:  # a padded vocabulary: generate only ids the tokenizer decodes,
        generation["suppress_tokens"] = list(range(tokens.vocab_size, cfg.model.vocab_size))  # as stem-generate
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
    shutil.copy(tokenizer, tmp / "tokenizer.json")
    (tmp / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokens.eod_token, "eos_token": tokens.eod_token,
         "pad_token": tokens.eod_token, "model_max_length": cfg.model.seq_length, "clean_up_tokenization_spaces": False,
         "padding_side": "left"},  # batched generate() continues every prompt from its last token
        indent=2))
    for file in MODEL_FILES:
        shutil.copy(HERE / file, tmp / file)
    for file in tmp.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    os.replace(tmp, out)
    fsync_dir(out.parent)
    return out
