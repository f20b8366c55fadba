"""The single-process export: one directory any machine can evaluate or serve, whatever layout trained it.

Layout (format ``stem-megatron-export-v1``)::

    config.json      the RunConfig as ``dataclasses.asdict`` (the training config, layout included)
    model.pt         torch.save({"format": FORMAT, "weights": {name: full tensor}})
    tokenizer.json   the HF ``tokenizers`` file of the data dir (when there is one)
    hash_counts.npy  Hash-MoE token counts, when ``hash_moe.hash_map`` is ``frequency:<counts.npy>``

Weight names and shapes are those of ``named_parameters()`` of the single-process model
(``single_process.build_single_process_model``: TP=PP=EP=1, ``host_tables.placement=device``): every STEM
table is one full V x d_ff parameter ``decoder.layers.{i}.mlp.U_l.weight``, layers and Hash-MoE
experts carry global indices (``model.sharding.global_name``). The checkpoint code writes it after
gathering TP/PP/EP shards and the host-resident tables; ``read_export`` checks it against the model
its config builds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Mapping, Optional

import torch
from omegaconf.errors import OmegaConfBaseException

from stem_megatron.config import RunConfig, to_run_config
from stem_megatron.config_moves import upgrade_saved_config
from stem_megatron.durable import fsync_dir, write_synced
from stem_megatron.export.single_process import parameter_shapes

FORMAT = "stem-megatron-export-v1"
CONFIG, WEIGHTS, TOKENIZER, HASH_COUNTS = "config.json", "model.pt", "tokenizer.json", "hash_counts.npy"
_FREQUENCY = "frequency:"


class ExportError(ValueError):
    """An export directory is missing, incomplete, corrupt or does not match its config."""


def write_export(out_dir, run_config: RunConfig, weights: Mapping[str, torch.Tensor],
                 tokenizer_path=None) -> Path:
    """Write an export atomically: files go to a temporary sibling directory, are fsynced, then renamed.

    ``tokenizer_path`` defaults to ``<run_config.data.dir>/tokenizer.json`` when that file exists.
    ``out_dir`` must not exist yet (an export is never overwritten in place).
    """
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"export directory {out} already exists: remove it or choose another --out")
    tokenizer = _tokenizer_source(run_config, tokenizer_path)
    bad = [name for name, t in weights.items() if not isinstance(name, str) or not isinstance(t, torch.Tensor)]
    if bad:
        raise TypeError(f"weights must map parameter names to tensors; bad entries: {bad[:10]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt of this process id
    tmp.mkdir()
    try:
        config = dataclasses.asdict(run_config)
        hash_map = run_config.hash_moe.hash_map
        if run_config.stem.variant == "hash_moe" and hash_map.startswith(_FREQUENCY):
            _copy(Path(hash_map[len(_FREQUENCY):]), tmp / HASH_COUNTS)
            config["hash_moe"]["hash_map"] = _FREQUENCY + HASH_COUNTS  # resolved against the export by read_export
        write_synced(tmp / CONFIG, json.dumps(config, indent=2).encode())
        payload = {"format": FORMAT, "weights": {name: _compact(t) for name, t in weights.items()}}
        with open(tmp / WEIGHTS, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        if tokenizer is not None:
            _copy(tokenizer, tmp / TOKENIZER)
        fsync_dir(tmp)
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_export(path) -> tuple[RunConfig, dict[str, torch.Tensor], Optional[Path]]:
    """``(run_config, weights, tokenizer.json path or None)`` of an export, checked against its model (an export
    with the flat ``stem`` layout read into the current one).

    Building the reference model needs a TP=PP=EP=1 megatron state (started here when none exists).
    """
    root = Path(path)
    if not root.is_dir():
        raise ExportError(f"export directory {root} does not exist (a run writes one with checkpoint.export=DIR)")
    config_file, weights_file = root / CONFIG, root / WEIGHTS
    for f in (config_file, weights_file):
        if not f.is_file():
            raise ExportError(f"{f} is missing: {root} is not a complete export (re-export the checkpoint)")
    try:
        cfg = to_run_config(upgrade_saved_config(json.loads(config_file.read_text())))
    except (json.JSONDecodeError, OmegaConfBaseException) as e:
        raise ExportError(f"{config_file} is not a valid RunConfig: {e}") from None
    if cfg.hash_moe.hash_map == _FREQUENCY + HASH_COUNTS:
        cfg.hash_moe.hash_map = _FREQUENCY + str(root / HASH_COUNTS)
    try:
        payload = torch.load(weights_file, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises RuntimeError/EOFError/UnpicklingError for damaged archives
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""  # torch's messages run to several lines
        raise ExportError(f"{weights_file} is corrupt or truncated ({type(e).__name__}: {first}); re-export it") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ExportError(f"{weights_file} has format {found!r}, expected {FORMAT!r}: write it with write_export")
    weights = payload.get("weights")
    if not isinstance(weights, dict):
        raise ExportError(f"{weights_file} has no weights dict: write it with write_export")
    check_weights(parameter_shapes(cfg), weights, str(weights_file))
    tokenizer = root / TOKENIZER
    return cfg, weights, tokenizer if tokenizer.is_file() else None


def check_weights(expected: Mapping[str, torch.Size], weights: Mapping[str, torch.Tensor], source: str) -> None:
    """Raise ExportError listing missing names, unexpected names and shape mismatches."""
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    shapes = [f"{n}: {tuple(weights[n].shape)} != expected {tuple(expected[n])}"
              for n in sorted(set(expected) & set(weights)) if weights[n].shape != expected[n]]
    problems = [f"{label} ({len(items)}): {', '.join(items[:20])}{' ...' if len(items) > 20 else ''}"
                for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes))
                if items]
    if problems:
        raise ExportError(f"{source} does not match the single-process model its config.json builds; "
                          + "; ".join(problems))


def _tokenizer_source(cfg: RunConfig, tokenizer_path) -> Optional[Path]:
    if tokenizer_path is not None:
        if not Path(tokenizer_path).is_file():
            raise FileNotFoundError(f"tokenizer {tokenizer_path} does not exist")
        return Path(tokenizer_path)
    default = Path(cfg.data.dir) / TOKENIZER
    return default if default.is_file() else None


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor owning just its elements (torch.save of a view would store its whole storage)."""
    t = t.detach().cpu()
    return t.clone() if t.untyped_storage().nbytes() != t.nbytes or not t.is_contiguous() else t


def _copy(src: Path, dst: Path) -> None:
    if not src.is_file():
        raise FileNotFoundError(f"{src} does not exist (needed in the export as {dst.name})")
    write_synced(dst, src.read_bytes())
