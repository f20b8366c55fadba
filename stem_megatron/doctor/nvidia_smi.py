"""The GPUs the driver lists, without torch: the standard library only, so ``tools/gpu_check.py``'s pre-checks run
it on a node's Python before any setup, and the test suite asks it before torch sees the GPUs."""

from __future__ import annotations

import shutil
import subprocess


def nvidia_smi_gpus() -> int:
    """GPUs the driver lists (``nvidia-smi -L``); 0 without a driver."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())
