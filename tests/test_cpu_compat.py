"""The CPU redirection of megatron-core's CUDA calls (run in a fresh process: it changes torch globally)."""

import multiprocessing as mp

import pytest


def _probe(queue):
    import torch

    from stem_megatron import cpu_compat

    before = None
    try:
        torch.empty(2, device="cuda")
    except (RuntimeError, AssertionError) as e:
        before = type(e).__name__
    cpu_compat.enable()
    cpu_compat.enable()  # idempotent
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    x = torch.ones(3)
    out = {
        "before": before,
        "empty": torch.empty(2, device="cuda").device.type,
        "empty_int": torch.zeros(2, device=torch.cuda.current_device()).device.type,
        "to": x.to("cuda:0").device.type,
        "cuda_is_self": x.cuda() is x,
        "type": x.type(),
        "type_cast": x.type(torch.float64).dtype == torch.float64,
    }
    torch.manual_seed(5)
    model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
    a = torch.rand(1)
    state = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        torch.rand(10)  # consumes the tracker's model-parallel stream, not the default one
    out["fork_restores_default_rng"] = torch.equal(torch.get_rng_state(), state)
    out["default_stream_continues"] = a.item() != torch.rand(1).item()
    # megatron DDP's bucket collectives: identities on a one-rank group, run without gloo's staging copy
    import os

    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as buffers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 20000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    buf = torch.arange(8.0)
    gathered = buffers.dist_all_gather_func(buf, buf[:], group=None, async_op=False)
    into = torch.zeros(8)
    buffers.dist_reduce_scatter_func(into, buf, group=None, async_op=False)
    out["one_rank_identity"] = gathered is None and torch.equal(buf, torch.arange(8.0)) and torch.equal(into, buf)
    dist.destroy_process_group()
    queue.put(out)


@pytest.mark.slow
def test_cuda_calls_are_redirected_to_cpu():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_probe, args=(queue,))
    proc.start()
    out = queue.get(timeout=120)
    proc.join()
    assert out["before"] is not None  # without the module this machine cannot place tensors on "cuda"
    assert out["empty"] == out["empty_int"] == out["to"] == "cpu"
    assert out["cuda_is_self"]
    assert out["type"] == "torch.cuda.FloatTensor" and out["type_cast"]
    assert out["fork_restores_default_rng"] and out["default_stream_continues"]
    assert out["one_rank_identity"]


def test_the_installed_megatron_release_is_the_checked_one():
    """No version notice for the release cpu_compat was checked against, wherever the venv is: megatron-core 0.19
    appends the hash of the git repository around its files to ``megatron.core.__version__`` (0.19.2+<our commit>
    for `make setup`'s .venv inside the checkout, as in CI), which made every CPU run warn."""
    import subprocess
    import sys
    from importlib import metadata

    from stem_megatron import cpu_compat

    assert metadata.version("megatron-core") == cpu_compat.CHECKED_MEGATRON_CORE  # pyproject's pin, checked here
    script = """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from stem_megatron import cpu_compat
    cpu_compat.enable()
print([str(w.message) for w in caught if "was checked against" in str(w.message)])
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
