"""A Hugging Face model directory's config.json as this repo's model fields, checked against a run before any
process group starts (``config.validate``): every refusal is one line naming the problem and the fix.

Imported architectures: Llama (``LlamaForCausalLM``), Qwen2 (``Qwen2ForCausalLM``: q/k/v biases) and a dense
stem-megatron Hugging Face export (``StemForCausalLM`` with no STEM layer, ``stem-export-hf``: the same names).
Both config.json conventions are read: transformers 5's ``rope_parameters`` and the older ``rope_theta`` /
``rope_scaling``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from stem_megatron.checkpoint.hf.shards import shard_problem
from stem_megatron.config import ConfigError, RunConfig

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "StemForCausalLM")
REQUIRED = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _fail(directory: Path, message: str) -> None:
    raise ConfigError(f"checkpoint.init_from_hf: {directory} {message}")


@dataclass(frozen=True)
class HFModel:
    """What the import needs of a Hugging Face directory: its ``ModelConfig`` fields and how its tensors read."""

    directory: Path
    architecture: str
    fields: dict  # ModelConfig fields it fixes (vocab_size: the HF model's, before any padding)
    tied: bool  # tie_word_embeddings: lm_head is embed_tokens (the import unties them: docs/checkpoints.md)

    @property
    def vocab_size(self) -> int:
        return self.fields["vocab_size"]

    def overrides(self, vocab_size: int | None = None) -> str:
        """The ``model.*`` overrides of a run of this model (``vocab_size``: padded for the layout)."""
        fields = {**self.fields, "vocab_size": vocab_size or self.vocab_size}
        return " ".join(f"model.{k}={'null' if v is None else v}" for k, v in fields.items())


def _rope(config: dict, directory: Path) -> tuple[float, float | None]:
    """(rope theta, Llama 3 scaling factor or None) of either config.json convention (a stem-megatron export:
    ``rope_scaling_factor``)."""
    if config.get("model_type") == "stem_megatron":
        return config.get("rope_theta", 10000.0), config.get("rope_scaling_factor")
    params = config.get("rope_parameters") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3" or any(scaling.get(k) != v for k, v in _LLAMA3_ROPE.items()):
        _fail(directory, f"uses RoPE scaling {scaling}: the import takes none or Llama 3's (rope_type llama3, "
                         f"{_LLAMA3_ROPE}), which megatron applies")
    return theta, float(scaling["factor"])


def read_hf_model(directory) -> HFModel:
    """The model of ``directory`` (config.json); an unreadable or unsupported one raises ConfigError."""
    directory = Path(directory)
    file = directory / "config.json"
    if not file.is_file():
        _fail(directory, "is not a Hugging Face model directory (no config.json): give the directory "
                         "save_pretrained wrote (config.json, *.safetensors, tokenizer.json)")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        _fail(directory, f"has a config.json that is not JSON ({e})")
    architecture = (config.get("architectures") or [None])[0]
    if architecture not in ARCHITECTURES:
        _fail(directory, f"holds a {architecture or config.get('model_type') or 'model of no named architecture'}: "
                         f"the import takes {', '.join(ARCHITECTURES)}")
    if architecture == "StemForCausalLM" and config.get("stem_layers"):
        _fail(directory, f"is a STEM model (layers {config['stem_layers']} are STEM): the import takes a dense model; "
                         "continue a STEM run from its checkpoint with checkpoint.init_from")
    missing = [k for k in REQUIRED if not isinstance(config.get(k), int)]
    if missing:
        _fail(directory, f"has a config.json without {', '.join(missing)}: not a complete {architecture} config")
    heads, d = config["num_attention_heads"], config["hidden_size"]
    unsupported = [(config.get("hidden_act", "silu") != "silu", f"hidden_act={config.get('hidden_act')}"),
                   (config.get("head_dim", d // heads) != d // heads,
                    f"head_dim={config.get('head_dim')} (not hidden_size/num_attention_heads)"),
                   (bool(config.get("mlp_bias")), "mlp_bias=true"),
                   (architecture == "LlamaForCausalLM" and bool(config.get("attention_bias")),
                    "attention_bias=true (o_proj has a bias too)"),
                   (bool(config.get("use_sliding_window")), "use_sliding_window=true")]
    for bad, what in unsupported:
        if bad:
            _fail(directory, f"has {what}, which megatron's Llama-style layer spec here does not build")
    theta, factor = _rope(config, directory)
    if float(theta) != int(theta):
        _fail(directory, f"has rope theta {theta}, not a whole number (megatron's rotary_base is an integer)")
    fields = {"num_layers": config["num_hidden_layers"], "hidden_size": d,
              "ffn_hidden_size": config["intermediate_size"], "num_attention_heads": heads,
              "num_query_groups": config.get("num_key_value_heads") or heads, "vocab_size": config["vocab_size"],
              "rotary_base": int(theta), "norm_epsilon": float(config.get("rms_norm_eps", 1e-6)),
              "qkv_bias": architecture == "Qwen2ForCausalLM" or bool(config.get("attention_bias")),
              "rope_scaling_factor": factor}
    return HFModel(directory, architecture, fields, bool(config.get("tie_word_embeddings", False)))


def _tokenizer_vocab(path: Path) -> dict:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)


def check_hf_import(cfg: RunConfig) -> HFModel:
    """``cfg`` can start from ``checkpoint.init_from_hf``: its model fields are the HF model's (the vocabulary may be
    padded: ``model.vocab_size`` >= the HF one), its tokenizer fits the model and is the one ``data.dir`` was
    tokenized with, its weights are there, whole and finite (``shards``)."""
    hf = read_hf_model(cfg.checkpoint.init_from_hf)
    directory, m = hf.directory, cfg.model
    if cfg.stem.variant == "hash_moe":
        _fail(directory, "is a dense model, and Hash-MoE's experts have no weights in it: import it as dense or as a "
                         "STEM variant (its planned layers converted)")
    mine = {k: getattr(m, k) for k in hf.fields}
    mine["num_query_groups"] = m.num_query_groups or m.num_attention_heads
    tp = cfg.parallel.tensor_model_parallel_size
    padded = -(-hf.vocab_size // tp) * tp
    for key, value in hf.fields.items():
        same = mine[key] >= value if key == "vocab_size" else mine[key] == value
        if not same:
            _fail(directory, f"has {key}={value} where the run has model.{key}={mine[key]}: set the model's fields "
                             f"to the checkpoint's ({hf.overrides(max(padded, m.vocab_size))})")
    if not sorted(directory.glob("*.safetensors")):
        _fail(directory, "has no *.safetensors weights: save the model with save_pretrained(safe_serialization=True)")
    tokenizer = directory / "tokenizer.json"
    if not tokenizer.is_file():
        _fail(directory, "has no tokenizer.json: the run's data must be tokenized with the model's tokenizer "
                         "(a fast tokenizer's file)")
    vocab = _tokenizer_vocab(tokenizer)
    if max(vocab.values()) >= hf.vocab_size:
        _fail(directory, f"has a tokenizer of {max(vocab.values()) + 1} ids, more than the model's vocab_size="
                         f"{hf.vocab_size}: the model cannot embed them; give the tokenizer the model was trained with")
    if _tokenizer_vocab(Path(cfg.data.dir) / "tokenizer.json") != vocab:
        _fail(directory, f"has another tokenizer than data.dir={cfg.data.dir}: tokenize the data with the model's, "
                         f"stem-preprocess --tokenizer {tokenizer} ...")
    problem = shard_problem(directory)  # last: it reads every weight
    if problem:
        _fail(directory, problem)
    return hf
