"""Can torch use this node's GPUs, and if not, why and what fixes it.

The usual cause on a cluster: ``make setup`` ran on the login node, which has no GPU, and installed the CPU build
of torch (and no Transformer Engine) into the venv the compute nodes share.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from stem_megatron.doctor.nvidia_smi import nvidia_smi_gpus

SETUP_ON_GPU_NODE = "srun -N1 --gpus-per-node=1 make setup STEM_DEVICE=gpu"


def gpu_count() -> int:
    """This node's GPUs, whether or not torch can use them."""
    return torch.cuda.device_count() if torch.cuda.is_available() else nvidia_smi_gpus()


def cuda_problem(wanted: int = 1) -> Optional[str]:
    """Why torch cannot give ``wanted`` processes one GPU each, naming the fix; None when it can."""
    if torch.version.cuda is None:
        return f"this venv has a CPU build of torch ({torch.__version__}): run `{SETUP_ON_GPU_NODE}`"
    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU: check `nvidia-smi` "
                f"here and that the job asked for GPUs (--gpus-per-node); a driver older than CUDA "
                f"{torch.version.cuda} needs torch for an older CUDA: rm -rf .venv, then `TORCH_INDEX_URL="
                f"https://download.pytorch.org/whl/cu126 {SETUP_ON_GPU_NODE}`")
    found = torch.cuda.device_count()
    if found < wanted:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        return (f"{wanted} processes need {wanted} GPUs but torch sees {found} (CUDA_VISIBLE_DEVICES={visible}): "
                f"ask for --gpus-per-node={wanted} or set NPROC")
    return None
