"""``python -m stem_megatron.doctor.job_start NPROC OVERRIDE...``: what ``slurm/_launch.sh`` checks on a GPU job's
first node before ``srun`` starts training.

Exits 2 with the fix when torch cannot give NPROC processes a GPU each (e.g. the venv has a CPU build of torch
because setup ran on the login node), instead of a CPU run over gloo or an error deep inside megatron. Otherwise
prints the run's tensor-parallel size, from its recipe and overrides composed as ``stem-train`` does (so the
launcher needs no parsing of Hydra syntax, and a misspelt override fails here, before srun).
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> None:
    nproc, *overrides = sys.argv[1:] if argv is None else argv
    from stem_megatron.doctor.cuda import cuda_problem
    from stem_megatron.recipes import compose_run

    problem = cuda_problem(int(nproc))
    if problem:
        _fail(f"GPUs requested, but {problem}")
    try:
        cfg = compose_run(overrides)
    except Exception as e:  # noqa: BLE001 - Hydra's and the schema's messages say what is wrong
        _fail(f"the overrides do not compose: {e}")
    print(cfg.parallel.tensor_model_parallel_size)


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
