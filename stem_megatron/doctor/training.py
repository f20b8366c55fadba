"""The training check: the tiny demo model for a few steps on the CPU over gloo (``CUDA_VISIBLE_DEVICES=""``, so
megatron runs through ``cpu_compat``) and, with GPUs, the same job on them over NCCL, losses compared step by step.

With GPUs, both jobs start from one checkpoint, written by a one-step CPU job and loaded with
``checkpoint.init_from``: left to themselves the GPU run draws its initial weights from the CUDA generator (and TE's
layers) and the CPU run from the CPU one, and the losses would differ by the initialisation rather than by the
arithmetic; without GPUs the CPU job starts from its own. The batches depend on the seed only, so both see the same
tokens. The layout is TP=2 with PP=2 on 4+ GPUs, TP=2 on 2 or 3, one GPU alone on 1;
TP=2 on a CPU-only machine.

Tolerance, ``BF16_RTOL`` = 2e-2: every step's GPU loss within 2 % of the CPU loss. The GPU run computes in bf16
(8 significant bits: a rounding is off by up to 2^-8, about 4e-3, relative) where the CPU run uses fp32, so the
losses can differ by a few 1e-3 from the first step, and the gap grows over the Adam steps (lr 3e-3; Adam's normalised
updates do not shrink with the rounding noise in the gradients): 2e-2 leaves that room, so a healthy node passes.
It is a smoke test: it catches NaN/inf, a run that does not learn and a divergence beyond what another seed gives
(measured: two CPU runs with different seeds differ by up to 2e-2 in these ten steps), not a subtle error; the CPU
parallel-equivalence tests are the exact checks.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from stem_megatron.doctor.report import OK, SKIPPED, Broken, Result, run_check
from stem_megatron.parallel import child_env

BF16_RTOL = 2e-2
JOB_TIMEOUT_S = 1800
_ERROR = re.compile(r"^[\w.]*(Error|Exception)\b.*: .+")


def layout(gpus: int) -> tuple[int, int]:
    """(TP, PP) of the comparison on ``gpus`` GPUs (0: the CPU-only check)."""
    if gpus >= 4:
        return 2, 2
    return (1, 1) if gpus == 1 else (2, 1)


def loss_mismatches(gpu: Sequence[float], cpu: Sequence[float], rtol: float = BF16_RTOL) -> list[str]:
    """The steps where the GPU loss is not within ``rtol`` of the CPU loss (relative to it), as messages; a step
    missing from either run or a non-finite loss is a mismatch too. Empty: the runs agree."""
    problems = []
    if len(gpu) != len(cpu):
        problems.append(f"the GPU run logged {len(gpu)} steps, the CPU run {len(cpu)}")
    for step, (g, c) in enumerate(zip(gpu, cpu), start=1):
        if not (math.isfinite(g) and math.isfinite(c) and abs(g - c) <= rtol * abs(c)):
            problems.append(f"step {step}: GPU {g:.4f} vs CPU {c:.4f}")
    return problems


def _error_line(log: Path) -> str:
    """The last exception message in a job's log (the worker's, not torchrun's summary), else its last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR.match(line) and "ChildFailedError" not in line]
    return (errors or lines or ["no output"])[-1]


def train_job(name: str, workdir: Path, nproc: int, overrides: Sequence[str], env: dict[str, str]) -> list[float]:
    """``torchrun --standalone -m stem_megatron.train`` into ``workdir/name`` (its log beside it); the step losses."""
    out, log = workdir / name, workdir / f"{name}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "stem_megatron.train", *overrides, f"out_dir={out}"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:  # timed out, or Ctrl-C: the job runs in a session of its own, end all of it
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if code is None:
        raise Broken(f"the {name} job did not finish in {JOB_TIMEOUT_S} s (log: {log})")
    if code != 0:
        raise Broken(f"the {name} job failed (exit {code}): {_error_line(log)} (log: {log})")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in records]


def train_and_compare(data: Path, steps: int, gpus: int, workdir: Path,
                      gpu_env: Optional[dict[str, str]] = None, blocked: Optional[str] = None) -> list[Result]:
    """The CPU job and, with ``gpus``, the GPU job (environment ``gpu_env``, default this one's) compared to it;
    ``blocked`` (why not to train, e.g. a failed environment check) skips both."""
    tp, pp = layout(gpus)
    where = f"TP={tp}" + (f" PP={pp}" if pp > 1 else "")
    if blocked is None and not (data / "tokenizer.json").is_file():
        blocked = f"no demo corpus in {data} (make setup prepares it)"
    common = ["model=tiny", f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
              f"data.dir={data}", "checkpoint.resume=false", "train.eval_iters=0", "train.log_interval=1"]
    start = [f"checkpoint.init_from={workdir / 'init' / 'checkpoints'}"] * bool(gpus) + [f"train.steps={steps}"]
    cpu_env = child_env(CUDA_VISIBLE_DEVICES="")
    cpu_losses: list[float] = []

    def cpu() -> tuple[str, str]:
        if blocked:
            return SKIPPED, blocked
        if gpus:
            train_job("init", workdir, tp * pp, [*common, "train.steps=1"], cpu_env)
        cpu_losses.extend(train_job("cpu", workdir, tp * pp, [*common, *start], cpu_env))
        return OK, f"{steps} steps at {where} over gloo, loss {cpu_losses[0]:.3f} -> {cpu_losses[-1]:.3f}"

    def gpu() -> tuple[str, str]:
        if not gpus:
            return SKIPPED, "no GPU"
        if not cpu_losses:
            return SKIPPED, blocked or "the CPU run (the reference) failed"
        losses = train_job("gpu", workdir, tp * pp, [*common, *start], gpu_env or child_env())
        problems = loss_mismatches(losses, cpu_losses)
        if problems:
            raise Broken(f"losses differ from the CPU run's by more than {BF16_RTOL} relative: "
                         f"{'; '.join(problems[:3])} (runs in {workdir}: report it with both metrics.jsonl files)")
        worst = max(abs(g - c) / abs(c) for g, c in zip(losses, cpu_losses))
        return OK, f"{steps} steps at {where} on {tp * pp} GPU(s) within {BF16_RTOL} of the CPU run (max {worst:.1e})"

    return [run_check("CPU training", cpu, "see the log"), run_check("GPU training vs CPU", gpu, "see the log")]
