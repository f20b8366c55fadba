"""``stem-train``: Hydra entry point (``torchrun --nproc_per_node N -m stem_megatron.train key=value ...``).

Recipes live in ``recipes/`` (composed as ``stem_megatron/recipes.py`` says) and are checked against the
typed ``RunConfig`` schema, so a misspelt key or a wrong type fails at composition, before any process
group starts.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from stem_megatron.config import to_run_config
from stem_megatron.recipes import RECIPES


@hydra.main(version_base=None, config_path=RECIPES, config_name="train")
def main(cfg: DictConfig) -> None:
    from stem_megatron.training.loop import run

    run(to_run_config(cfg))


if __name__ == "__main__":
    main()
