"""``stem-doctor`` on this machine (no GPU): GPU items skipped, the environment and CPU training checks pass, exit 0,
and nothing on stderr; a broken DeepSpeed op fails it naming the fix; a GPU node without Transformer Engine warns and
still trains; the GPU-vs-CPU comparison run end to end with the "GPU" job on the CPU; the loss tolerance and the TE
version range; where torch / TE / Apex come from (the venv, or the environment it was layered on) and the pins setup
writes for what it reuses; the launcher's job-start check."""

import subprocess
import sys
import sysconfig
import tomllib
import types
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from stem_megatron.doctor import checks, cli, cuda, job_start, layered, training, versions
from stem_megatron.doctor.report import FAIL, OK, SKIPPED, Result, run_check
from stem_megatron.host_tables import row_optimizer
from stem_megatron.parallel import child_env

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_doctor_passes_here_with_gpu_items_skipped():
    proc = subprocess.run([sys.executable, "-m", "stem_megatron.doctor.cli"], capture_output=True, text=True,
                          env=child_env(), timeout=900)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""  # no warnings, no tracebacks, no build output
    for name in ("CUDA", "NCCL", "Transformer Engine", "pinned memory", "GPU training vs CPU"):
        assert f"skipped  {name}: no GPU" in lines
    for name in ("versions", "DeepSpeed CPU Adam op", "/dev/shm"):
        assert any(line.startswith(f"ok       {name}: ") for line in lines), name
    assert any(line.startswith("ok       CPU training: 10 steps at TP=2 over gloo, loss ") for line in lines)
    assert lines[-1] == "stem-doctor: every check that applies here passed"


def test_broken_deepspeed_op_fails_naming_the_fix(monkeypatch, capsys, tmp_path):
    def no_compiler():
        raise RuntimeError("Error building extension 'cpu_adam'\nninja: build stopped: subcommand failed.")

    monkeypatch.setattr(row_optimizer, "_kernel", no_compiler)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        cli.main([])
    out, err = capsys.readouterr()
    assert exit_.value.code == 1
    assert ("FAIL     DeepSpeed CPU Adam op: RuntimeError: Error building extension 'cpu_adam'; fix: run `make setup`"
            in out)
    assert "skipped  CPU training: fix the FAIL above first (DeepSpeed CPU Adam op)" in out
    assert "stem-doctor: 1 check(s) failed: DeepSpeed CPU Adam op" in out
    assert "Traceback" not in out + err


def test_gpu_node_without_transformer_engine_warns_and_trains(monkeypatch, capsys):
    """A GPU node (its GPU checks pass) without TE: a WARN naming the setup that installs TE, both training jobs
    run (megatron's local layers train on the GPU), and the doctor passes."""
    real_installed = versions.installed
    monkeypatch.setattr(versions, "installed", lambda name: None if name == versions.TE else real_installed(name))
    for name in ("check_cuda", "check_nccl", "check_pinned_memory"):
        monkeypatch.setattr(checks, name, lambda: (OK, "as on a GPU node"))
    monkeypatch.setattr(cuda, "gpu_count", lambda: 4)
    asked = {}

    def train_and_compare(data, steps, gpus, workdir, blocked=None):
        asked.update(gpus=gpus, blocked=blocked)
        return [Result(OK, "CPU training", "trained"), Result(OK, "GPU training vs CPU", "compared")]

    monkeypatch.setattr(training, "train_and_compare", train_and_compare)
    cli.main([])  # no SystemExit: exit status 0
    lines = capsys.readouterr().out.splitlines()
    assert ("WARN     Transformer Engine: not installed: GPU runs use megatron's local layers (slower); for TE run "
            "`srun -N1 --gpus-per-node=1 make setup STEM_DEVICE=gpu`") in lines
    assert asked == {"gpus": 4, "blocked": None}
    assert lines[-1] == "stem-doctor: every check that applies here passed (1 warning(s): Transformer Engine)"


@pytest.mark.parametrize("version, loads, status, detail", [
    ("2.17.1", True, OK, "2.17.1 (supported: <2.21,>=2.9)"),
    ("2.8.0", True, FAIL, "2.8.0 is outside the supported <2.21,>=2.9 (the gpu extra): "
                          "run `srun -N1 --gpus-per-node=1 make setup STEM_DEVICE=gpu`"),
    ("2.17.1", False, FAIL, "ModuleNotFoundError: import of transformer_engine.pytorch halted; None in sys.modules; "
                            "fix: run `srun -N1 --gpus-per-node=1 make setup STEM_DEVICE=gpu`"),
], ids=["in range", "outside the range", "does not load"])
def test_an_installed_transformer_engine_must_load_and_be_in_range(monkeypatch, version, loads, status, detail):
    """Only a missing TE is a warning: one that is there but outside the gpu extra's range, or does not import,
    fails (a stand-in module plays the TE that imports)."""
    monkeypatch.setattr(versions, "installed", lambda name: version)
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch",
                        types.ModuleType("transformer_engine.pytorch") if loads else None)
    result = run_check("Transformer Engine", checks.check_transformer_engine,
                       "run `srun -N1 --gpus-per-node=1 make setup STEM_DEVICE=gpu`")
    assert (result.status, result.detail) == (status, detail)


@pytest.mark.slow
def test_gpu_comparison_end_to_end_with_the_gpu_job_on_cpu(tmp_path):
    """The GPU branch's jobs (init checkpoint, reference, compared run) and comparison, its "GPU" job on the CPU:
    same weights and batches, so the losses agree exactly."""
    results = training.train_and_compare(cli.DEMO_DATA, 3, 2, tmp_path, gpu_env=child_env(CUDA_VISIBLE_DEVICES=""))
    assert [r.status for r in results] == [OK, OK], results
    assert results[1].detail == "3 steps at TP=2 on 2 GPU(s) within 0.02 of the CPU run (max 0.0e+00)"
    assert (tmp_path / "init" / "checkpoints" / "latest").exists()


@pytest.mark.parametrize("gpus, jobs", [(0, {"cpu": False}), (2, {"init": False, "cpu": True, "gpu": True})])
def test_the_jobs_start_from_one_checkpoint_only_where_they_are_compared(monkeypatch, tmp_path, gpus, jobs):
    """Without GPUs the CPU job trains from its own initialisation (no one-step init job); with GPUs both compared
    jobs load the init job's checkpoint. ``jobs``: each job started, in order, and whether it loads that one."""
    started = {}

    def train_job(name, workdir, nproc, overrides, env):
        started[name] = f"checkpoint.init_from={tmp_path / 'init' / 'checkpoints'}" in overrides
        return [8.0, 7.5, 7.0]

    monkeypatch.setattr(training, "train_job", train_job)
    results = training.train_and_compare(cli.DEMO_DATA, 3, gpus, tmp_path)
    assert [r.status for r in results] == [OK, OK if gpus else SKIPPED], results
    assert list(started.items()) == list(jobs.items())


def test_loss_comparison_tolerance():
    cpu = [8.35, 8.10, 7.60]
    assert training.loss_mismatches([8.36, 8.05, 7.70], cpu) == []  # bf16-sized differences (< 2e-2 relative)
    assert training.loss_mismatches([8.35, 8.10, 7.80], cpu) == ["step 3: GPU 7.8000 vs CPU 7.6000"]  # 2.6e-2
    assert training.loss_mismatches([8.35, float("nan"), 7.60], cpu) == ["step 2: GPU nan vs CPU 8.1000"]
    assert training.loss_mismatches([8.35, 8.10], cpu) == ["the GPU run logged 2 steps, the CPU run 3"]
    assert training.loss_mismatches([8.5], [8.35], rtol=1e-2) == ["step 1: GPU 8.5000 vs CPU 8.3500"]


NODE_SITE = Path("/opt/torch/.venv/lib/python3.12/site-packages")
NGC_SITE = Path("/usr/local/lib/python3.12/dist-packages")


@pytest.mark.parametrize("dists, line", [
    ([("torch", "2.13.0", None)],
     "torch 2.13.0 (venv, fits >=2.6), megatron-core 0.19.2, deepspeed 0.19.8, transformer-engine not installed"),
    ([("torch", "2.11.0+cu130", NODE_SITE)],
     f"torch 2.11.0+cu130 (from {NODE_SITE}, fits >=2.6), megatron-core 0.19.2, deepspeed 0.19.8, "
     "transformer-engine not installed"),
    ([("torch", "2.8.0a0+5228986c39.nv25.6", NGC_SITE), ("transformer-engine", "2.17.0+4e0f6ab", NGC_SITE),
      ("apex", "0.1", NGC_SITE)],
     f"torch 2.8.0a0+5228986c39.nv25.6 (from {NGC_SITE}, fits >=2.6), megatron-core 0.19.2, deepspeed 0.19.8, "
     f"transformer-engine 2.17.0+4e0f6ab (from {NGC_SITE}, fits the gpu extra's <2.21,>=2.9), apex 0.1 (from "
     f"{NGC_SITE})"),
    ([("torch", "2.13.0", None), ("transformer-engine", "2.8.0", None)],
     "torch 2.13.0 (venv, fits >=2.6), megatron-core 0.19.2, deepspeed 0.19.8, transformer-engine 2.8.0 (venv, not "
     "in the gpu extra's <2.21,>=2.9)"),
], ids=["venv", "layered on a venv", "NGC container", "TE outside the gpu extra"])
def test_versions_line_says_where_torch_te_and_apex_come_from_and_whether_they_fit(monkeypatch, dists, line):
    found = {name: layered.Found(name, version, where or Path("/venv/site"), where is None)
             for name, version, where in dists}
    monkeypatch.setattr(layered, "machine_built", lambda: found)
    assert checks.check_versions() == (OK, line)


def test_a_torch_outside_the_projects_requirement_fails_the_versions_check(monkeypatch):
    monkeypatch.setattr(layered, "machine_built", lambda: {"torch": layered.Found("torch", "2.5.1", NODE_SITE, False)})
    monkeypatch.setattr(versions, "unmet_requirements", lambda: ["torch 2.5.1 is not >=2.6"])
    result = run_check("versions", checks.check_versions, "run `make setup`")
    assert result.status == FAIL
    assert result.detail == (f"torch 2.5.1 is not >=2.6 (torch 2.5.1 (from {NODE_SITE}, not in >=2.6), megatron-core "
                             "0.19.2, deepspeed 0.19.8, transformer-engine not installed): run `make setup`")


def _stub_venv(venv: Path, dists: dict[str, str], system_site: bool = False) -> Path:
    """A venv (no pip) whose site-packages holds only the dist-info of ``dists`` (name: version); its site dir."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", *["--system-site-packages"] * system_site,
                    str(venv)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv)}))
    for name, version in dists.items():
        info = site / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return site


def test_setup_pins_what_a_layered_venv_reuses(tmp_path):
    """tools/setup.sh's step: in a venv layered on a node's venv (a .pth names its site-packages), torch, every TE
    distribution and Apex are pinned at their versions, nothing else is; a venv's own torch shadows the node's and
    is not pinned, and a venv that reuses nothing has no constraints file (an old one goes)."""
    node = _stub_venv(tmp_path / "node", {"torch": "2.11.0+cu130", "transformer_engine": "2.9.0+a1b2c3",
                                          "transformer_engine_torch": "2.9.0", "apex": "0.1", "numpy": "2.5.5"})
    pins = tmp_path / "constraints.txt"

    def reuse(venv: Path) -> str:
        return subprocess.run([str(venv / "bin" / "python"), "-m", "stem_megatron.doctor.layered", str(pins)],
                              capture_output=True, text=True, cwd=REPO, check=True).stdout

    venv = tmp_path / "venv"
    (_stub_venv(venv, {}, system_site=True) / "_stem_layered_on.pth").write_text(f"{node}\n")
    assert reuse(venv) == (f"reusing apex 0.1, torch 2.11.0+cu130, transformer-engine 2.9.0+a1b2c3, "
                           f"transformer-engine-torch 2.9.0 from {node}: not installed here, pinned in {pins}\n")
    assert pins.read_text() == ("apex==0.1\ntorch==2.11.0+cu130\ntransformer-engine==2.9.0+a1b2c3\n"
                                "transformer-engine-torch==2.9.0\n")

    own = tmp_path / "own"
    pth = _stub_venv(own, {"torch": "2.13.0"}) / "_stem_layered_on.pth"
    pth.write_text(f"{node}\n")
    assert reuse(own).startswith("reusing apex 0.1, transformer-engine 2.9.0+a1b2c3, ")
    assert pins.read_text() == "apex==0.1\ntransformer-engine==2.9.0+a1b2c3\ntransformer-engine-torch==2.9.0\n"
    pth.unlink()
    assert reuse(own) == "" and not pins.exists()


def test_transformer_engine_version_range():
    supported = versions.te_range()  # our gpu extra's, from our installed metadata (megatron-core 0.19.2's has none)
    assert str(supported) == "<2.21,>=2.9"
    for version in ("2.9.0", "2.17.1", "2.20.0+4e0f6ab", "2.20.0rc1"):  # releases, an NGC build, a pre-release
        assert versions.in_range(version, supported), version
    for version in ("2.8.0", "2.9.0rc1", "2.21.0", "2.21.0.dev0", "3.0.0", "not-a-version"):
        assert not versions.in_range(version, supported), version
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert Requirement(extra[0]).specifier == supported  # the installed metadata is this checkout's pyproject


def test_layout_of_the_comparison():
    assert [training.layout(n) for n in (0, 1, 2, 3, 4, 8)] == [(2, 1), (1, 1), (2, 1), (2, 1), (2, 2), (2, 2)]


def test_job_start_prints_tp_and_stops_on_cpu_torch(monkeypatch, capsys):
    monkeypatch.setattr(torch.version, "cuda", None)  # a venv set up on a login node: CPU torch
    with pytest.raises(SystemExit) as exit_:
        job_start.main(["2", "parallel=tp2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "this venv has a CPU build of torch" in err
    assert "srun -N1 --gpus-per-node=1 make setup STEM_DEVICE=gpu" in err

    monkeypatch.setattr(torch.version, "cuda", "13.0")  # CUDA torch on a node whose GPUs it cannot use
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        job_start.main(["2", "parallel=tp2"])
    assert exit_.value.code == 2 and "finds no usable GPU: check `nvidia-smi`" in capsys.readouterr().err

    monkeypatch.setattr(cuda, "cuda_problem", lambda wanted: None)  # as on a GPU node
    for overrides, tp in ((["parallel=tp2"], "2"), (["+experiment=pretrain_1b", "variant=stem_1_3"], "1"),
                          (["parallel=tp2", "parallel.tensor_model_parallel_size=4"], "4")):
        job_start.main(["8", *overrides])
        assert capsys.readouterr().out == f"{tp}\n", overrides
    with pytest.raises(SystemExit) as exit_:
        job_start.main(["8", "parallel.tensor_size=2"])
    assert exit_.value.code == 2 and "the overrides do not compose" in capsys.readouterr().err
