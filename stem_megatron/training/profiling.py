"""One training step under ``torch.profiler`` (``logging.profile_step=N``), written by rank 0.

``<out_dir>/profile_stepN.txt`` holds torch's ``key_averages`` tables of the step's ops, by self device time (on a
GPU) and by self CPU time; ``profile_stepN.json`` the same ops as records (name, calls, self CPU / device seconds,
the slowest first) and the memory peaks of the process so far (``torch.cuda.max_memory_allocated`` on a GPU, the
peak resident set size anywhere). Other ranks run the step unprofiled. The step's ``step_time_s`` includes the
profiler's own overhead: leave it out of timings (``benchmarks/gpu_step.py`` does).
"""

from __future__ import annotations

import contextlib
import json
import resource
from pathlib import Path
from typing import Iterator

import torch

TABLE_ROWS = 25  # rows of each text table


@contextlib.contextmanager
def profiled(enabled: bool, out_dir: str, step: int) -> Iterator[None]:
    """Profile the body when ``enabled`` (rank 0's profile step), else run it as it is."""
    if not enabled:
        yield
        return
    gpu = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        yield
        if gpu:
            torch.cuda.synchronize()  # the step's last kernels belong to it
    write_profile(prof, Path(out_dir), step, gpu)


def _ops(averages, gpu: bool) -> list[dict]:
    ops = [{"name": e.key, "calls": e.count, "self_cpu_s": e.self_cpu_time_total / 1e6,
            "cpu_total_s": e.cpu_time_total / 1e6,
            "self_device_s": (e.self_device_time_total / 1e6) if gpu else None} for e in averages]
    return sorted(ops, key=lambda op: (op["self_device_s"] or 0.0, op["self_cpu_s"]), reverse=True)


def write_profile(prof, out_dir: Path, step: int, gpu: bool) -> None:
    averages = prof.key_averages()
    tables = []
    if gpu:
        tables.append(f"step {step}: ops by self CUDA time\n"
                      + averages.table(sort_by="self_device_time_total", row_limit=TABLE_ROWS))
    tables.append(f"step {step}: ops by self CPU time\n"
                  + averages.table(sort_by="self_cpu_time_total", row_limit=TABLE_ROWS))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"profile_step{step}.txt").write_text("\n\n".join(tables) + "\n")
    record = {"step": step, "device": "gpu" if gpu else "cpu",
              "max_memory_allocated_bytes": torch.cuda.max_memory_allocated() if gpu else None,
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
              "ops": _ops(averages, gpu)}
    (out_dir / f"profile_step{step}.json").write_text(json.dumps(record, indent=1) + "\n")
