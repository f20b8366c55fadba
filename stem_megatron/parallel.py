"""Process groups for a run: torch.distributed + megatron-core's TP/PP/DP grid, on GPU or CPU.

On a machine without CUDA the backend is gloo and ``cpu_compat`` redirects megatron's CUDA calls;
with CUDA it is NCCL, one device per local rank. Call after the config has been validated.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from torch.distributed.elastic.utils.distributed import get_free_port

from stem_megatron import cpu_compat


def single_process_env() -> None:
    """Lets a run start without torchrun, as a world of one (no-op under torchrun/srun)."""
    if "WORLD_SIZE" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(get_free_port()))


RENDEZVOUS_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env(**extra: str) -> dict[str, str]:
    """This process' environment for a child that starts its own world: without the rendezvous variables
    ``single_process_env`` set here (the child would otherwise try to join, or bind, this process' port)."""
    return {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS} | extra


def on_gpu() -> bool:
    return torch.cuda.is_available()


def have_transformer_engine() -> bool:
    """TE linears are used on GPU when installed (the ``gpu`` extra); megatron's local ones otherwise."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def initialize(tp: int, pp: int, seed: int, ep: int = 1) -> None:
    """Start the default process group (env:// from torchrun/srun) and megatron's parallel groups."""
    device = None  # NCCL: this rank's GPU, so that collectives without a tensor (barrier) need not guess it
    if on_gpu():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        cpu_compat.enable()
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=10), device_id=device)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
