"""Run megatron-core's parallel layers, schedules and DDP on a CPU-only machine over gloo.

megatron-core is written for CUDA: it passes ``torch.cuda.current_device()`` or the literal ``"cuda"``
as a ``device``, calls ``Tensor.cuda()``, ``torch.cuda.synchronize()`` and forks the CUDA RNG state in
attention. On a machine without a GPU we redirect exactly those calls to the CPU:

* a ``TorchFunctionMode`` rewrites a CUDA ``device`` argument (``"cuda"``, ``"cuda:N"``, an int,
  a ``torch.device('cuda')``) to ``"cpu"``, makes ``Tensor.cuda()`` return the tensor itself, and has
  ``Tensor.type()`` report the CUDA type name (``torch.cuda.FloatTensor``) that megatron's optimizers
  and grad clipping check parameters against;
* ``torch.cuda.current_device/synchronize/get_rng_state/set_rng_state/manual_seed`` and megatron's
  ``_get_cuda_rng_state/_set_cuda_rng_state`` act on the CPU generator instead;
* ``torch.cuda.Stream/Event/current_stream/stream`` (used by megatron's MoE all-to-all dispatcher to
  overlap device-to-host copies) become no-op stand-ins: CPU work is synchronous, and all stand-in
  streams compare equal, so megatron sees no side stream to synchronise with; the dispatcher's
  ``maybe_move_tensor_to_cpu`` (which only converts CUDA tensors) returns the split sizes as numpy
  arrays on the CPU too, as ``all_to_all_single`` needs them;
* megatron DDP's bucket collectives with the distributed optimizer (the grad buffer's reduce-scatter, the
  param buffer's all-gather) are identities on a one-rank data-parallel group, where the rank's shard is the
  whole buffer: they are skipped there. gloo would run them through a flat staging copy of the whole bucket
  (one bucket holds every parameter unless ``parallel.overlap_grad_reduce`` cuts it): a transient P x 4 bytes
  twice a step, the peak of a CPU process whose model dominates its memory (docs/memory.md). NCCL on GPU works in
  place.

Checked against megatron-core 0.19.2 with torch 2.13.0 (Python 3.12; the CPU build and the CUDA build on a machine
without a GPU). It is enabled by
``stem_megatron.parallel.initialize`` only when ``torch.cuda.is_available()`` is false (or when forced),
so GPU runs never see it. No megatron code is copied or its classes changed.
"""

from __future__ import annotations

import contextlib
import threading
from importlib import metadata

import torch
from torch.overrides import TorchFunctionMode

from stem_megatron import quiet

CHECKED_MEGATRON_CORE = "0.19.2"

_state = threading.local()


def _is_cuda(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Maps CUDA device arguments to the CPU for every torch call made while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _cpu_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(state: torch.Tensor, *_args, **_kwargs) -> None:
    torch.set_rng_state(state)


def _noop(*_args, **_kwargs) -> None:
    return None


def _one_rank_identity(collective):
    """``collective(output, input, ...)`` of megatron DDP's buckets, skipped on a one-rank group (the
    output then holds the input: megatron passes the rank's shard, the whole buffer, as one of them).
    ``call.collective`` is what runs on larger groups: a tool that counts collectives wraps that."""

    def call(output, input, *args, group=None, async_op=False, **kwargs):
        if torch.distributed.get_world_size(group) == 1:
            if output.data_ptr() != input.data_ptr():
                output.view(-1).copy_(input.view(-1))
            return None
        return call.collective(output, input, *args, group=group, async_op=async_op, **kwargs)

    call.one_rank_identity = True
    call.collective = collective
    return call


def _host_tensor(tensor, as_numpy: bool = False, record_stream: bool = False):
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


class _CpuEvent:
    def __init__(self, *_args, **_kwargs):
        pass

    record = wait = synchronize = _noop

    def query(self) -> bool:
        return True


class _CpuStream:
    def __init__(self, *_args, **_kwargs):
        pass

    wait_stream = wait_event = synchronize = _noop

    def record_event(self, event=None) -> _CpuEvent:
        return event or _CpuEvent()

    def __eq__(self, other) -> bool:
        return isinstance(other, _CpuStream)

    def __hash__(self) -> int:
        return 0


_STREAM = _CpuStream()


def enable() -> None:
    """Activate the CPU redirection in this thread (idempotent)."""
    if getattr(_state, "mode", None) is not None:
        return
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import token_dispatcher

    # the installed release: megatron.core.__version__ appends the short hash of whatever git repository holds its
    # files (0.19.2+<our commit> when the venv sits in this checkout, as `make setup` makes it)
    found = metadata.version("megatron-core")
    if found != CHECKED_MEGATRON_CORE:
        import warnings

        warnings.warn(
            f"stem_megatron.cpu_compat was checked against megatron-core {CHECKED_MEGATRON_CORE}, "
            f"found {found}; run tests/test_cpu_compat.py before trusting results."
        )
    quiet.install_cpu()
    # "cpu", not an index: autograd runs custom backward functions (megatron's all-to-all) outside
    # the function mode, where an int device would mean CUDA
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = _noop
    torch.cuda.Stream, torch.cuda.Event = _CpuStream, _CpuEvent
    torch.cuda.current_stream = lambda *_args, **_kwargs: _STREAM
    torch.cuda.stream = lambda *_args, **_kwargs: contextlib.nullcontext()
    torch.cuda.manual_seed = torch.manual_seed
    torch.cuda.get_rng_state = _cpu_rng_state
    torch.cuda.set_rng_state = _set_cpu_rng_state
    mcore_random._get_cuda_rng_state = _cpu_rng_state
    mcore_random._set_cuda_rng_state = _set_cpu_rng_state
    token_dispatcher.maybe_move_tensor_to_cpu = _host_tensor
    for name in ("dist_all_gather_func", "dist_reduce_scatter_func"):
        collective = getattr(param_and_grad_buffer, name)
        if not getattr(collective, "one_rank_identity", False):
            setattr(param_and_grad_buffer, name, _one_rank_identity(collective))
    _state.mode = _CudaToCpu()
    _state.mode.__enter__()


def is_enabled() -> bool:
    return getattr(_state, "mode", None) is not None
