"""The environment checks: each returns ``(status, detail)`` or raises ``Broken`` naming the fix (``report.run_check``
adds the generic fix to any other error). GPU items report ``skipped: no GPU`` on a machine without one."""

from __future__ import annotations

import shutil
from typing import Sequence

import torch

from stem_megatron.doctor import versions
from stem_megatron.doctor.cuda import SETUP_ON_GPU_NODE, cuda_problem
from stem_megatron.doctor.report import OK, SKIPPED, WARN, Broken, Result, first_line, run_check
from stem_megatron.flops.memory import Layout, node_shared_bytes
from stem_megatron.recipes import compose_run

NO_GPU = (SKIPPED, "no GPU")
PINNED_TEST_BYTES = 256 << 20


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_versions() -> tuple[str, str]:
    """torch / TE / Apex with where each comes from (the venv, or the environment it was layered on) and whether
    it fits; megatron-core and DeepSpeed, which setup always installs into the venv, by version."""
    torch_, te, *apex = versions.found()
    others = [f"{name} {versions.installed(name) or 'not installed'}" for name in ("megatron-core", "deepspeed")]
    found = ", ".join([torch_, *others, te, *apex])
    unmet = versions.unmet_requirements()
    if unmet:
        raise Broken(f"{'; '.join(unmet)} ({found}): run `make setup`")
    return OK, found


def check_cuda() -> tuple[str, str]:
    problem = cuda_problem()
    if problem:
        raise Broken(problem)
    count = torch.cuda.device_count()
    names = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(count)}))
    return OK, f"{count} x {names} (torch {torch.__version__}, CUDA {torch.version.cuda})"


def check_nccl() -> tuple[str, str]:
    import torch.distributed as dist

    if not dist.is_nccl_available():
        raise Broken(f"torch {torch.__version__} has no NCCL backend: run `{SETUP_ON_GPU_NODE}`")
    return OK, "NCCL " + ".".join(map(str, torch.cuda.nccl.version()))


def check_transformer_engine() -> tuple[str, str]:
    """Without TE, GPU runs train on megatron's local layers (slower, not wrong): a WARN. A TE that is there but
    does not load or is outside the supported range would break the GPU runs: a FAIL."""
    version = versions.installed(versions.TE)
    if version is None:
        return WARN, f"not installed: GPU runs use megatron's local layers (slower); for TE run `{SETUP_ON_GPU_NODE}`"
    import transformer_engine.pytorch  # noqa: F401 - loads the compiled extension against this torch

    supported = versions.te_range()
    if not versions.in_range(version, supported):
        raise Broken(f"{version} is outside the supported {supported} (the gpu extra): run `{SETUP_ON_GPU_NODE}`")
    return OK, f"{version} (supported: {supported})"


def check_cpu_adam() -> tuple[str, str]:
    from stem_megatron.host_tables.row_optimizer import RowAdam, extensions_root, lean_kernel

    RowAdam((0.9, 0.95), 1e-8, 0.0)  # loads the op as training does, building it on first use
    lean_kernel()  # the lean table state's update (host_tables.state_dtype and co.)
    return OK, f"loads (built in {extensions_root()})"


def check_pinned_memory() -> tuple[str, str]:
    host = torch.arange(PINNED_TEST_BYTES // 4, dtype=torch.float32).pin_memory()
    back = host.to("cuda", non_blocking=True).to("cpu", non_blocking=True)
    torch.cuda.synchronize()
    if not torch.equal(host, back):
        raise Broken("a pinned host -> GPU -> host copy came back changed: check the GPU and driver (nvidia-smi -q)")
    return OK, f"{_gib(PINNED_TEST_BYTES)} pinned, copied to the GPU and back"


def check_shm(overrides: Sequence[str]) -> tuple[str, str]:
    run = " ".join(overrides) or "the demo"
    try:
        cfg = compose_run(overrides)
    except Exception as e:  # noqa: BLE001 - Hydra's and the schema's messages say what is wrong
        raise Broken(f"the overrides {run!r} do not compose: {first_line(e)}") from None
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    need = sum(node_shared_bytes(cfg, Layout(1, tp * pp, tp, pp), 0).values())  # one node: every row's moments
    free = shutil.disk_usage("/dev/shm").free
    if free < need:
        raise Broken(f"{_gib(free)} free, {run}'s host tables need {_gib(need)} on one node: ask the job for more "
                     f"memory (tmpfs counts against it), or use host_tables.placement=device / more pipeline stages / "
                     f"more nodes (`stem-flops --memory {' '.join(overrides)} --nodes N` plans them)")
    return OK, f"{_gib(free)} free, {run}'s host tables need {_gib(need)} on one node"


def _gpu_only(check, gpu: bool, cuda_ok: bool):
    if not gpu:
        return lambda: NO_GPU
    return check if cuda_ok else lambda: (SKIPPED, "the CUDA check failed")


def environment(gpu: bool, overrides: Sequence[str] = ()) -> list[Result]:
    """Every environment check, printed as it completes; GPU ones skipped without a GPU, and after a CUDA failure."""
    results = [run_check("versions", check_versions, "run `make setup`")]
    cuda = run_check("CUDA", _gpu_only(check_cuda, gpu, True), f"run `{SETUP_ON_GPU_NODE}`")
    results.append(cuda)
    ok = cuda.status == OK
    results += [
        run_check("NCCL", _gpu_only(check_nccl, gpu, ok), f"run `{SETUP_ON_GPU_NODE}`"),
        run_check("Transformer Engine", _gpu_only(check_transformer_engine, gpu, ok), f"run `{SETUP_ON_GPU_NODE}`"),
        run_check("DeepSpeed CPU Adam op", check_cpu_adam,
                  "run `make setup` (it builds the op into the venv; needs a C++ compiler)"),
        run_check("pinned memory", _gpu_only(check_pinned_memory, gpu, ok),
                  "check `ulimit -l` (locked memory) and the driver (nvidia-smi)"),
        run_check("/dev/shm", lambda: check_shm(overrides), "check that /dev/shm is a mounted tmpfs"),
    ]
    return results
