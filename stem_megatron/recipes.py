"""The recipes (``recipes/``) and how ``stem-train`` composes them with Hydra overrides into a ``RunConfig``.

Registers the schema and the resolvers the recipes use on import, so ``stem-train`` and every command that
plans or checks a run before launch (``stem-flops --memory``, ``stem-doctor``) read one composition.

A run's default directory (``out_dir: ${run_dir:...}`` in ``recipes/train.yaml``) carries a digest of
what decides its training, so a run never resumes an unrelated run's checkpoint while the same command
(a requeue, a rerun) finds its own again; each job of a sweep (``-m``) runs in its own directory under the
sweep's.

A ``host_tables`` or ``hash_moe`` key set under ``stem`` (``stem_megatron/config_moves.py``), on the command line or
in a recipe, is refused before Hydra composes the run, with one line naming its place.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType
from hydra.errors import ConfigCompositionException, HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from stem_megatron.config import RunConfig, to_run_config
from stem_megatron.config_moves import flat_stem, refuse_moved_in_recipe, refuse_moved_override

RECIPES = str(Path(__file__).resolve().parent.parent / "recipes")

# what decides a run's training (a run resumed with other values would not continue it); "stem": the flat stem
# (config_moves.flat_stem), so a run keeps its directory
_IGNORED = {"train": ("log_interval", "exit_after_steps", "eval_interval", "eval_iters", "max_skipped_steps",
                      "skip_steps"),
            "stem": ("prefetch_depth", "cache_rows", "shm_dir", "host_memory_gib", "overlap_exchange",
                     "overlap_update", "resident_rows", "calibration_gib")}
# fields that runs named without them lack, left out at their defaults: a run keeps its directory
_ADDED = {"model": {"qkv_bias": False, "rope_scaling_factor": None},
          "stem": {"calibration_tokens": None, "state_dtype": "fp32", "second_moment": "element",
                   "master_dtype": "fp32"}}


def _multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def run_dir(base: str, _root_: DictConfig) -> str:
    """``<base>-<digest of model, stem, host_tables, hash_moe, parallel, train, data, checkpoint.init_from and
    init_from_hf>``; in a
    sweep, the job's own directory under the sweep's (``hydra.sweep.dir/hydra.sweep.subdir``)."""
    if _multirun():
        return HydraConfig.get().runtime.output_dir
    identity = {key: OmegaConf.to_container(_root_[key], resolve=True)
                for key in ("model", "stem", "host_tables", "hash_moe", "parallel", "train", "data")}
    identity["stem"] = flat_stem(identity["stem"], identity.pop("host_tables"), identity.pop("hash_moe"))
    for key, fields in _IGNORED.items():
        for name in fields:
            identity[key].pop(name, None)
    for key, fields in _ADDED.items():
        for name, default in fields.items():
            if identity[key].get(name) == default:
                del identity[key][name]
    identity["init_from"] = _root_.checkpoint.init_from
    if _root_.checkpoint.init_from_hf:  # only when set, as the fields above
        identity["init_from_hf"] = _root_.checkpoint.init_from_hf
    digest = hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]
    return f"{base}-{digest}"


ConfigStore.instance().store(name="run_schema", node=RunConfig)
OmegaConf.register_new_resolver("slug", lambda value: str(value).replace("/", "_"), replace=True)  # paths
OmegaConf.register_new_resolver("run_dir", run_dir, replace=True)


def compose_run(overrides: Sequence[str] = ()) -> RunConfig:
    """The typed config of ``stem-train <overrides>`` (``recipes/train.yaml`` and the groups it names); a
    ``host_tables``/``hash_moe`` key set under ``stem`` raises ConfigError."""
    from hydra import compose, initialize_config_dir

    refuse_moved_override(overrides)
    with initialize_config_dir(config_dir=RECIPES, version_base=None):
        try:
            return to_run_config(compose("train", overrides=list(overrides)))
        except ConfigCompositionException as e:
            refuse_moved_in_recipe(e)
            raise


def refuse_moved_keys(argv: Sequence[str]) -> None:
    """ConfigError when ``stem-train``'s command line ``argv`` or a recipe it composes sets a
    ``host_tables``/``hash_moe`` key under ``stem``.

    Composes the run (a sweep: each of its choices once, ``_single_runs``) before Hydra does, whose error would name
    only the key missing from ``stem``. Any other error is Hydra's to report then; so are the recipes of a
    ``--config-dir``, not read here."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser  # how hydra.main reads the command line

    args = get_args_parser().parse_args(argv)
    refuse_moved_override(args.overrides)
    try:
        runs = _single_runs(args.overrides)
    except HydraException:  # an override Hydra cannot parse: its error says so
        return
    with initialize_config_dir(config_dir=RECIPES, version_base=None):
        for overrides in runs:
            try:
                compose(args.config_name or "train", overrides=overrides)
            except Exception as e:  # noqa: BLE001 - any other error is Hydra's to report when it composes the run
                refuse_moved_in_recipe(e)


def _single_runs(overrides: Sequence[str]) -> list[list[str]]:
    """The overrides of single runs that together read every recipe a sweep of ``overrides`` reads: each choice
    sweep (``variant=dense,stem_1_3``) at its first value, then at each other value in turn. Other sweeps are left
    out: ranges and intervals set numbers, and a glob is not expanded here."""
    lines = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else
             [o.input_line] for o in OverridesParser.create().parse_overrides(list(overrides))
             if not o.is_sweep_override() or o.value_type in (ValueType.CHOICE_SWEEP, ValueType.SIMPLE_CHOICE_SWEEP)]
    base = [values[0] for values in lines]
    return [base] + [base[:i] + [value] + base[i + 1:] for i, values in enumerate(lines) for value in values[1:]]
