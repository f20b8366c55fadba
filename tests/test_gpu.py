"""The GPU paths for real, where ``nvidia-smi`` lists a GPU (deselected elsewhere: tests/conftest.py). The rest of the
suite hides the GPUs, so each test here runs its work in a subprocess given them back (``gpu_env``)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data_cache" / "python-doc"


def _run(args, env, timeout=1800):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)


def test_doctor_trains_on_the_gpu_as_on_the_cpu(gpu_env):
    """stem-doctor's GPU-vs-CPU comparison, the check a new GPU node runs first: every environment check passes
    or warns (Transformer Engine may be absent), and the tiny model's losses on the GPU follow the CPU run's."""
    proc = _run(["-m", "stem_megatron.doctor.cli", "--steps", "5", "--data", str(DEMO)], gpu_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok       GPU training vs CPU" in proc.stdout, proc.stdout


def test_gpu_training_with_host_tables_learns_and_prints_no_known_warning(gpu_env, tmp_path):
    """A few bf16 steps of the demo model with host tables on one GPU: finite, falling losses, and none of the
    warnings a GPU run printed at every step (torch's RMSNorm dtype mismatch, NCCL's barrier device guess)."""
    proc = _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m", "stem_megatron.train",
                 "parallel=single", "stem.placement=host", "train.steps=8", "train.eval_iters=0",
                 "checkpoint.resume=false", f"data.dir={DEMO}", f"out_dir={tmp_path}"], gpu_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    for known in ("Mismatch dtype between input and weight", "barrier(): using the device"):
        assert known not in proc.stderr, proc.stderr


def test_pinned_staging_delivers_every_fetch_intact(gpu_env):
    """Rows gathered into the pinned ring and copied on the side stream equal the host rows of their fetch, over
    more fetches than the ring has buffers, with the host table changed after every fetch (a buffer reused while
    its copy is in flight would deliver the next fetch's bytes)."""
    script = """
import torch
from stem_megatron.host_tables.transfer import HostToDevice
h2d = HostToDevice(torch.device("cuda", 0), staging_buffers=2)
table = torch.randn(4096, 256)
fetched, expected = [], []
for step in range(12):
    ids = torch.randint(0, 4096, (3000,))
    with h2d.stream():
        fetched.append(h2d.gather(table, ids))
        ready = h2d.record()
    expected.append(table[ids].clone())
    table.add_(1.0)  # the host table moves on, as after an optimizer step
torch.cuda.current_stream().wait_event(ready)
assert all(torch.equal(f.cpu(), e) for f, e in zip(fetched, expected))
print("intact")
"""
    proc = _run(["-c", script], gpu_env(), timeout=600)
    assert proc.returncode == 0 and "intact" in proc.stdout, proc.stdout + proc.stderr


def test_row_gradients_land_on_the_host_intact(gpu_env):
    """Row gradients copied into the pinned landing buffers on the side stream equal the device tensors they
    came from once their event has fired, with the device tensors freed and overwritten right after the copy
    is issued (the copy must hold them) and each key's buffer reused every other step, as CPU Adam reads the
    last step's while this one's land."""
    script = """
import torch
from stem_megatron.host_tables.transfer import DeviceToHost, landed
d2h = DeviceToHost(torch.device("cuda", 0))
kept = {}
for step in range(8):
    grads = torch.randn(3000 - step, 256, device="cuda")  # no larger than the first: the buffer is reused
    expected = grads.cpu()
    host, event = d2h.copy(grads, (1, step % 2))
    del grads
    torch.randn(4096, 256, device="cuda").mul_(2)  # the freed memory is taken again on the compute stream
    landed(event)
    assert torch.equal(host, expected), step
    if step % 2 in kept:
        assert host.data_ptr() == kept[step % 2]  # the key's buffer, reused
    kept[step % 2] = host.data_ptr()
    assert host.is_pinned()
print("landed")
"""
    proc = _run(["-c", script], gpu_env(), timeout=600)
    assert proc.returncode == 0 and "landed" in proc.stdout, proc.stdout + proc.stderr
