"""``stem-train``: Hydra entry point (``torchrun --nproc_per_node N -m stem_megatron.train key=value ...``).

Recipes live in ``recipes/`` and are checked against the typed ``RunConfig`` schema, so a misspelt
key or a wrong type fails at composition, before any process group starts.

A run's default directory (``out_dir: ${run_dir:...}`` in ``recipes/train.yaml``) carries a digest of
what decides its training, so a run never resumes an unrelated run's checkpoint while the same command
(a requeue, a rerun) finds its own again; each job of a sweep (``-m``) runs in its own directory under the
sweep's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from stem_megatron.config import RunConfig, to_run_config

RECIPES = str(Path(__file__).resolve().parent.parent / "recipes")

# what decides a run's training (a run resumed with other values would not continue it)
_IGNORED = {"train": ("log_interval", "exit_after_steps", "eval_interval", "eval_iters"),
            "stem": ("prefetch_depth", "cache_rows", "shm_dir")}


def _multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def run_dir(base: str, _root_: DictConfig) -> str:
    """``<base>-<digest of model, stem, parallel, train, data, checkpoint.init_from>``; in a sweep, the job's
    own directory under the sweep's (``hydra.sweep.dir/hydra.sweep.subdir``)."""
    if _multirun():
        return HydraConfig.get().runtime.output_dir
    identity = {key: OmegaConf.to_container(_root_[key], resolve=True)
                for key in ("model", "stem", "parallel", "train", "data")}
    for key, fields in _IGNORED.items():
        for name in fields:
            identity[key].pop(name, None)
    identity["init_from"] = _root_.checkpoint.init_from
    digest = hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]
    return f"{base}-{digest}"


ConfigStore.instance().store(name="run_schema", node=RunConfig)
OmegaConf.register_new_resolver("slug", lambda value: str(value).replace("/", "_"), replace=True)  # paths
OmegaConf.register_new_resolver("run_dir", run_dir, replace=True)


@hydra.main(version_base=None, config_path=RECIPES, config_name="train")
def main(cfg: DictConfig) -> None:
    from stem_megatron.training.loop import run

    run(to_run_config(cfg))


if __name__ == "__main__":
    main()
