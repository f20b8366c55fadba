"""Model architectures for the counts: the shape fields, read from an HF ``config.json`` or this
repo's ``ModelConfig`` fields, by preset name or path.

Presets: ``recipes/flops/`` (HF-style, e.g. ``qwen2.5_7b``) and ``recipes/model/`` (``ModelConfig``
fields, e.g. ``mobilellm_350m``); globs over their names (``'qwen2.5_*'``) expand.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
PRESET_DIRS = (REPO / "recipes" / "flops", REPO / "recipes" / "model")
DEFAULT_SEQ_LENGTH = 4096  # the paper's §3.1 context length

HF_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "vocab_size")
MODEL_CONFIG_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size")


class FlopsError(ValueError):
    """Bad input (missing/invalid config field, unknown preset, bad results row); the message names it."""


@dataclass(frozen=True)
class Arch:
    """The shape fields the counts need (SwiGLU FFN, GQA attention, RMSNorm)."""

    name: str
    hidden_size: int  # d
    ffn_hidden_size: int  # d_ff
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int
    seq_length: int | None = None  # default context for this preset (None: DEFAULT_SEQ_LENGTH)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2/2.5 have q/k/v biases: parameters only, never FLOPs
    source: str = ""

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


def _int_field(cfg: Mapping, key: str, where: str, required: bool = True, default: Any = None) -> Any:
    if key not in cfg or cfg[key] is None:
        if required:
            raise FlopsError(f"{where}: missing field '{key}'")
        return default
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FlopsError(f"{where}: field '{key}' must be a positive integer, got {value!r}")
    return value


def _check_heads(arch: Arch, heads_field: str, kv_field: str, where: str) -> Arch:
    if arch.num_attention_heads % arch.num_kv_heads:
        raise FlopsError(f"{where}: field '{kv_field}'={arch.num_kv_heads} does not divide "
                         f"'{heads_field}'={arch.num_attention_heads}")
    return arch


def arch_from_hf(cfg: Mapping, name: str = "model", source: str = "") -> Arch:
    """An HF ``config.json``-style mapping (hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, vocab_size; optional head_dim, tie_word_embeddings,
    seq_length, qkv_bias: else a Qwen2 ``model_type`` or ``attention_bias`` has q/k/v biases, as transformers
    builds them). A missing field raises FlopsError naming it."""
    where = source or name
    missing = [k for k in HF_FIELDS if cfg.get(k) is None]
    if missing:
        hint = (" (for multi-head attention set num_key_value_heads = num_attention_heads)"
                if missing == ["num_key_value_heads"] else "")
        raise FlopsError(f"{where}: missing field{'s' if len(missing) > 1 else ''} "
                         f"{', '.join(repr(k) for k in missing)} in the HF config{hint}")
    d = _int_field(cfg, "hidden_size", where)
    heads = _int_field(cfg, "num_attention_heads", where)
    head_dim = _int_field(cfg, "head_dim", where, required=False)
    if head_dim is None:
        if d % heads:
            raise FlopsError(f"{where}: 'hidden_size'={d} is not divisible by 'num_attention_heads'={heads}; "
                             f"set 'head_dim'")
        head_dim = d // heads
    arch = Arch(
        name=str(cfg.get("name") or name), hidden_size=d,
        ffn_hidden_size=_int_field(cfg, "intermediate_size", where),
        num_layers=_int_field(cfg, "num_hidden_layers", where),
        num_attention_heads=heads, num_kv_heads=_int_field(cfg, "num_key_value_heads", where),
        vocab_size=_int_field(cfg, "vocab_size", where), head_dim=head_dim,
        seq_length=_int_field(cfg, "seq_length", where, required=False),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("qkv_bias", cfg.get("model_type") == "qwen2" or cfg.get("attention_bias", False))),
        source=source,
    )
    return _check_heads(arch, "num_attention_heads", "num_key_value_heads", where)


def arch_from_model_config(cfg: Mapping, name: str = "model", source: str = "") -> Arch:
    """This repo's ``ModelConfig`` fields (recipes/model/*.yaml): untied embeddings, no biases but ``qkv_bias``'s."""
    where = source or name
    for key in MODEL_CONFIG_FIELDS:
        _int_field(cfg, key, where)
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if d % heads:
        raise FlopsError(f"{where}: 'hidden_size'={d} is not divisible by 'num_attention_heads'={heads}")
    arch = Arch(
        name=str(cfg.get("name") or name), hidden_size=d, ffn_hidden_size=cfg["ffn_hidden_size"],
        num_layers=cfg["num_layers"], num_attention_heads=heads,
        num_kv_heads=_int_field(cfg, "num_query_groups", where, required=False, default=heads),
        vocab_size=cfg["vocab_size"], head_dim=d // heads,
        seq_length=_int_field(cfg, "seq_length", where, required=False), qkv_bias=bool(cfg.get("qkv_bias", False)),
        source=source,
    )
    return _check_heads(arch, "num_attention_heads", "num_query_groups", where)


def arch_from_mapping(cfg: Mapping, name: str = "model", source: str = "") -> Arch:
    """HF-style if it has any HF-only key, this repo's ModelConfig if it has ``ffn_hidden_size``."""
    if not isinstance(cfg, Mapping):
        raise FlopsError(f"{source or name}: expected a mapping of config fields, got {type(cfg).__name__}")
    if "ffn_hidden_size" in cfg and not any(k in cfg for k in ("intermediate_size", "num_hidden_layers")):
        return arch_from_model_config(cfg, name, source)
    return arch_from_hf(cfg, name, source)


def read_mapping(path: Path) -> Any:
    """A JSON or YAML file's content; unreadable or malformed files raise FlopsError naming them."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise FlopsError(f"{path}: cannot read ({e.strerror})") from None
    try:
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise FlopsError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}") from None


def list_presets() -> dict[str, Path]:
    """Preset name -> file (recipes/flops first, then recipes/model)."""
    presets: dict[str, Path] = {}
    for directory in PRESET_DIRS:
        for path in sorted(directory.glob("*.yaml")):
            presets.setdefault(path.stem, path)
    return presets


def load_arch(spec: str) -> Arch:
    """A preset name, a path to an HF config.json / YAML (either field convention), or a Hugging Face model
    directory (its config.json)."""
    path = Path(spec)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    presets = list_presets()
    if spec in presets:
        path = presets[spec]
    elif not path.is_file():
        raise FlopsError(f"unknown model {spec!r}: not a file and not a preset "
                         f"({', '.join(sorted(presets))})")
    try:
        shown = str(path.relative_to(REPO))
    except ValueError:
        shown = str(path)
    return arch_from_mapping(read_mapping(path), name=path.stem if path.name != "config.json" else
                             path.parent.name, source=shown)


def expand_models(specs: Sequence[str]) -> list[str]:
    """Globs over preset names expand (sorted); everything else passes through."""
    out: list[str] = []
    presets = list_presets()
    for spec in specs:
        if any(c in spec for c in "*?[") and not Path(spec).exists():
            matches = sorted(fnmatch.filter(presets, spec), key=natural_key)
            if not matches:
                raise FlopsError(f"no preset matches {spec!r} ({', '.join(sorted(presets))})")
            out += matches
        else:
            out.append(spec)
    return out


def natural_key(name: str) -> tuple:
    """qwen2.5_1.5b < qwen2.5_3b < qwen2.5_14b: sort by the parameter count in the name when there is one."""
    tail = name.rsplit("_", 1)[-1].lower().rstrip("bm")
    try:
        return (name.rsplit("_", 1)[0], float(tail), name)
    except ValueError:
        return (name, 0.0, name)
