"""``stem-train``: Hydra entry point (``torchrun --nproc_per_node N -m stem_megatron.train key=value ...``).

Recipes live in ``recipes/`` (composed as ``stem_megatron/recipes.py`` says) and are checked against the
typed ``RunConfig`` schema, so a misspelt key or a wrong type fails at composition, before any process
group starts.

Bad input (a setting, a checkpoint, the data, too little host memory, a run too large for its GPUs' memory) ends
the run with one line naming the problem and the fix and exit code 1, not a traceback, as do ``train.max_skipped_steps``
steps in a row that are not finite (the line names the last good checkpoint): each of these errors says all
a user needs (out of device memory: what the memory plan expected per GPU and the settings that lower it). So does a sweep on
Hydra's submitit launchers without the `slurm` extra that provides them (Hydra's own error names no package), and a
``host_tables`` or ``hash_moe`` key set under ``stem`` (Hydra's own error names only the key it misses there).

The module imports nothing heavy until ``main`` runs: a process that the training process spawns imports its
``__main__`` again, this module, before it can work: a 2-rank run's first save on a 2-core machine takes 10.2 s when
that imports megatron-core and the training code, 4.2 s with this module light. Megatron's checkpoint writer's
results queue manager is forked (``checkpoint/dense.py``); any other spawned child pays for what this module imports,
and dies with its rank (``child_processes.die_with_parent``).

Before any process group starts, the run directory is this job's and writable (``training/run_dir.py``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from stem_megatron.setup_check import require_extra

if __name__ == "__mp_main__":  # a child a training process spawned (multiprocessing imports its __main__ again)
    from stem_megatron.child_processes import die_with_parent

    die_with_parent()

# the launchers hydra-submitit-launcher provides, and ours on top of one (recipes/hydra/launcher/slurm.yaml)
SUBMITIT_LAUNCHERS = {"submitit_local", "submitit_slurm", "slurm"}


def main() -> None:
    """The entry point: Hydra's ``train``, after naming the `slurm` extra when a sweep asks for one of its launchers
    and this Python lacks it, and after refusing a ``host_tables``/``hash_moe`` key set under ``stem``
    (``recipes.refuse_moved_keys``)."""
    launchers = {arg.partition("=")[2] for arg in sys.argv[1:] if arg.lstrip("+").startswith("hydra/launcher=")}
    if launchers & SUBMITIT_LAUNCHERS:
        require_extra("slurm", command="stem-train")
    import hydra

    from stem_megatron.config import ConfigError
    from stem_megatron.recipes import RECIPES, refuse_moved_keys

    try:
        refuse_moved_keys(sys.argv[1:])
    except ConfigError as e:
        report(e)
        sys.exit(1)
    hydra.main(version_base=None, config_path=RECIPES, config_name="train")(train)()


def train(cfg) -> None:
    """One run of the composed recipe (an omegaconf ``DictConfig``)."""
    from stem_megatron.checkpoint.atomic import CheckpointError
    from stem_megatron.config import ConfigError, to_run_config
    from stem_megatron.data.integrity import DataError
    from stem_megatron.host_tables.node import HostMemoryError
    from stem_megatron.training.components.skipped_steps import NotFiniteError
    from stem_megatron.training.device_memory import out_of_memory_in, out_of_memory_message
    from stem_megatron.training.loop import run
    from stem_megatron.training.run_dir import claimed

    run_cfg = None
    try:
        run_cfg = to_run_config(cfg)
        with claimed(run_cfg):
            run(run_cfg)
    except (ConfigError, CheckpointError, DataError, HostMemoryError, NotFiniteError) as e:
        report(e)
        sys.exit(1)
    except Exception as e:
        oom = out_of_memory_in(e)  # a step's torch.OutOfMemoryError, or another error raised from one
        if oom is None or run_cfg is None:
            raise
        report(out_of_memory_message(run_cfg, oom))
        sys.exit(1)


def report(error: Exception) -> None:
    """One line on stderr, from every rank that has the error: the first rank to exit makes torchrun stop the
    others, so no single rank is sure to get as far as printing. Under torchrun also its error file's message, which
    ``python -m stem_megatron.torchrun`` prints as the job's last line."""
    where = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    line = f"{where}error: {error}"
    # one write: the ranks of a node share torchrun's stderr, and print's text and newline could go out as two, the
    # other rank's line between them (seen: "...= 4[rank 1] error: ...")
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), f"{line}\n".encode())
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        Path(error_file).parent.mkdir(parents=True, exist_ok=True)
        Path(error_file).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))


if __name__ == "__main__":
    main()
