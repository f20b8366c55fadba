"""``stem-doctor [OVERRIDE...]``: checks this machine for training, one line per check, then trains the tiny model
on the CPU and on the GPUs (when there are any) and compares the losses. Exits 1 when a check fails, each FAIL
naming its fix; skipped checks (no GPU, no demo corpus) and warnings (no Transformer Engine) do not fail, and only a
FAIL keeps the training checks from running. See docs/gpu.md."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from stem_megatron.doctor.report import FAIL, WARN

DEMO_DATA = Path(__file__).resolve().parents[2] / "data_cache" / "python-doc"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stem-doctor",
        description="Checks this machine for training, one line per check (exit 1 when one fails), then trains the "
                    "tiny model on the CPU and on the GPUs and compares the losses. See docs/gpu.md.")
    parser.add_argument("overrides", nargs="*",
                        help="Hydra overrides of the run whose STEM tables /dev/shm must hold, e.g. "
                             "+experiment=pretrain_1b (default: the demo); the training check trains the tiny model")
    parser.add_argument("--steps", type=int, default=10, help="training steps of each compared job (default 10)")
    parser.add_argument("--data", type=Path, default=DEMO_DATA, help=f"the demo corpus (default {DEMO_DATA})")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    from stem_megatron.doctor import checks, training
    from stem_megatron.doctor.cuda import gpu_count

    gpus = gpu_count()
    results = checks.environment(gpus > 0, args.overrides)
    failed = [r.name for r in results if r.status == FAIL]
    workdir = Path(tempfile.mkdtemp(prefix="stem-doctor-"))
    blocked = f"fix the FAIL above first ({', '.join(failed)})" if failed else None
    results += training.train_and_compare(args.data.resolve(), args.steps, gpus, workdir, blocked=blocked)
    failed = [r.name for r in results if r.status == FAIL]
    keep = failed and any(workdir.iterdir())
    if not keep:
        shutil.rmtree(workdir)
    if failed:
        print(f"stem-doctor: {len(failed)} check(s) failed: {', '.join(failed)}"
              + (f" (job logs kept in {workdir})" if keep else ""))
        sys.exit(1)
    warned = [r.name for r in results if r.status == WARN]
    print("stem-doctor: every check that applies here passed"
          + (f" ({len(warned)} warning(s): {', '.join(warned)})" if warned else ""))


if __name__ == "__main__":
    main()
