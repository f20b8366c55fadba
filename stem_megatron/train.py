"""``stem-train``: Hydra entry point (``torchrun --nproc_per_node N -m stem_megatron.train key=value ...``).

Recipes live in ``recipes/`` and are checked against the typed ``RunConfig`` schema, so a misspelt
key or a wrong type fails at composition, before any process group starts.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from stem_megatron.config import RunConfig, to_run_config

RECIPES = str(Path(__file__).resolve().parent.parent / "recipes")

ConfigStore.instance().store(name="run_schema", node=RunConfig)
OmegaConf.register_new_resolver("slug", lambda value: str(value).replace("/", "_"), replace=True)  # paths


@hydra.main(version_base=None, config_path=RECIPES, config_name="train")
def main(cfg: DictConfig) -> None:
    from stem_megatron.training.loop import run

    run(to_run_config(cfg))


if __name__ == "__main__":
    main()
