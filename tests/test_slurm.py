"""The SLURM job scripts, end to end on a one-node SLURM cluster on this machine.

``tools/slurm_local.sh`` installs and starts it (run here when we are root; it returns at once when the
cluster is already up). ``slurm/pretrain_1b.sh`` (a multi-node GPU script) then runs a tiny CPU job with
the overrides docs/cluster.md gives: 2 processes under torchrun's c10d rendezvous, launched by srun, and
SIGUSR1 (what ``--signal=B:USR1@120`` sends before the time limit) stops training with a checkpoint and
requeues the job, which resumes from it with no step redone. A GPU job whose venv has CPU torch stops before
srun, naming the fix.
The jobs keep STEM tables on the device so they do not wait for DeepSpeed's CPU Adam to JIT-compile.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import VOCAB

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "slurm" / "pretrain_1b.sh"
pytestmark = pytest.mark.slow

SBATCH_CPU = ["--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2", "--time=10"]


def tiny(corpus, out_dir, steps, parallel="tp2"):
    return ["model=tiny", f"parallel={parallel}", "model.num_layers=2", "model.seq_length=32",
            f"model.vocab_size={VOCAB}", f"data.vocab_size={VOCAB}", f"data.dir={corpus}", f"out_dir={out_dir}",
            f"train.steps={steps}", "train.log_interval=1", "train.micro_batch_size=4", "train.global_batch_size=8",
            # device tables: megatron clips them with the backbone, so the 1B recipe's separate clip is refused
            "host_tables.placement=device", "host_tables.clip=global"]


@pytest.fixture(scope="module")
def slurm():
    """A SLURM cluster with an idle node: started by tools/slurm_local.sh when root, else required."""
    if os.geteuid() == 0:
        proc = subprocess.run(["bash", str(REPO / "tools" / "slurm_local.sh")], capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, f"tools/slurm_local.sh failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    if shutil.which("sbatch") is None:
        pytest.fail("sbatch not found: start a local SLURM cluster first (sudo bash tools/slurm_local.sh)")
    nodes = [line.split() for line in subprocess.run(["sinfo", "-h", "-N", "-o", "%t %c"], capture_output=True,
                                                      text=True).stdout.splitlines()]
    assert any(state in ("idle", "mix") and int(cpus) >= 2 for state, cpus in nodes), (
        f"no idle SLURM node with 2 CPUs (sinfo: {nodes}); run tools/slurm_local.sh")


def job_info(job_id):
    out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def submit(tmp_path, *args, timeout=60, env=None):
    """sbatch from tmp_path (logs/ there), as on a cluster: NPROC=2 processes on a node without GPUs."""
    (tmp_path / "logs").mkdir(exist_ok=True)
    try:
        return subprocess.run(["sbatch", "--parsable", *args], cwd=tmp_path, capture_output=True, text=True,
                              env={**os.environ, "NPROC": "2", **(env or {})}, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # e.g. pending forever: say why, and do not leave the job behind
        job_id = (e.stdout or b"").decode().strip().split(";")[0]
        info = job_info(job_id) if job_id else {}
        if job_id:
            subprocess.run(["scancel", job_id])
        pytest.fail(f"job {job_id} not done after {timeout}s: {info.get('JobState')}, reason {info.get('Reason')}")


def test_pretrain_script_runs_tiny_cpu_job(slurm, corpus, tmp_path):
    out = tmp_path / "run"
    proc = submit(tmp_path, "--wait", *SBATCH_CPU, str(SCRIPT), *tiny(corpus, out, 3), timeout=300)
    job_id = proc.stdout.strip().split(";")[0]
    log = tmp_path / "logs" / f"pretrain_1b-{job_id}.out"  # #SBATCH --output=logs/%x-%j.out
    assert log.exists(), f"no job log {log}: {proc.stdout} {proc.stderr}"
    text = log.read_text()
    assert proc.returncode == 0, f"job {job_id} failed:\n{text[-4000:]}"
    info = job_info(job_id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", info
    assert "1 node(s) [" in text and "x 2 processes" in text and "--rdzv_backend c10d" in text
    assert "step      3/3" in text
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["name"] == "tiny" and config["model"]["num_layers"] == 2  # overrides win
    # the script's recipe where not overridden: variant=stem_1_3, +experiment=pretrain_1b's schedule
    assert config["stem"]["ratio"] == "1/3" and config["train"]["lr"] == 4e-4
    assert config["parallel"]["tensor_model_parallel_size"] == 2


def test_gpu_job_where_torch_sees_no_gpu_stops_before_srun(slurm, corpus, tmp_path):
    """A GPU job (GPUS_PER_NODE=2) on a node where torch can use no GPU ends at once with the fix instead of training
    on the CPU: a venv with CPU torch (setup ran on the login node), or CUDA torch on a node without usable GPUs (this
    machine: PyPI's torch for Python 3.12 is the CUDA build)."""
    import torch

    reason = "this venv has a CPU build of torch" if torch.version.cuda is None else "finds no usable GPU"
    proc = submit(tmp_path, "--wait", *SBATCH_CPU, str(SCRIPT), *tiny(corpus, tmp_path / "run", 3), timeout=120,
                  env={"GPUS_PER_NODE": "2"})
    job_id = proc.stdout.strip().split(";")[0]
    text = (tmp_path / "logs" / f"pretrain_1b-{job_id}.out").read_text()
    assert proc.returncode != 0 and job_info(job_id)["ExitCode"] == "2:0", text
    assert reason in text and "make setup STEM_DEVICE=gpu" in text
    assert "srun:" not in text and not (tmp_path / "run").exists()


def _node_states() -> list[str]:
    return subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True).stdout.split()


def wait_for(predicate, timeout, what, job_id=None, log=None):
    """Poll ``predicate``; with ``job_id``, fail at once with the job's log when the job has ended."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        state = job_info(job_id).get("JobState") if job_id else None
        if state in ("FAILED", "COMPLETED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            text = log.read_text()[-4000:] if log is not None and log.exists() else "(no log)"
            raise AssertionError(f"job {job_id} ended ({state}) while waiting for {what}:\n{text}")
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_usr1_stops_training_with_a_checkpoint_then_requeues_and_redoes_no_step(slurm, corpus, tmp_path):
    """What --signal=B:USR1@120 does shortly before the time limit: USR1 to the batch shell only, which passes it
    to the training processes (srun, our torchrun); they save after the step every rank agrees on, and the requeued
    job resumes there. No checkpoint by interval: the one it resumes from is the stop's."""
    out = tmp_path / "run"
    proc = submit(tmp_path, *SBATCH_CPU, str(SCRIPT), *tiny(corpus, out, 100_000), "checkpoint.save_interval=100000")
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    log = tmp_path / "logs" / f"pretrain_1b-{job_id}.out"
    metrics = out / "metrics.jsonl"
    latest = out / "checkpoints" / "latest"
    try:
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 180, "three steps",
                 job_id, log)
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)
        requeued = {"Restarts": "1", "JobState": "PENDING"}
        wait_for(lambda: requeued.items() <= job_info(job_id).items(), 120, "the requeue", job_id, log)
        saved = int(latest.read_text().strip().removeprefix("step_"))
        first = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
        assert first == list(range(1, saved + 1)), "the stopped job trained steps its checkpoint does not hold"
        # slurm holds a requeued job back ~2 minutes (Reason=BeginTime) so that the new attempt's credential is
        # younger than the old one's revocation, which slurmd compares in whole seconds; release it once the node is
        # done with the first attempt, and 2 s later (released at once, it was allocated in the requeue's second and
        # slurmd killed it: "Job credential revoked")
        wait_for(lambda: _node_states() == ["idle"], 60, "the node to be idle")
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+2"], check=True)
        wait_for(lambda: "resumed from" in log.read_text() and len(metrics.read_text().splitlines()) > saved + 1,
                 180, "the resumed run's steps", job_id, log)
        text = log.read_text()  # --open-mode=append: both attempts in one log
        assert f"stopped after step {saved} on SIGUSR1" in text
        assert f"requeueing job {job_id} (restart 1)" in text
        assert "restart 0:" in text and "restart 1:" in text
        assert f"after step {saved}" in text
        steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
        assert steps == list(range(1, len(steps) + 1))  # continued from the checkpoint, nothing repeated
        assert job_info(job_id)["JobState"] == "RUNNING"
    finally:
        subprocess.run(["scancel", job_id])
        wait_for(lambda: job_info(job_id).get("JobState") not in ("RUNNING", "PENDING", "COMPLETING"), 60,
                 f"job {job_id} to end")


def test_hydra_submitit_launcher_sweeps_on_slurm(slurm, corpus, tmp_path):
    """recipes/hydra/launcher/slurm.yaml: `-m hydra/launcher=slurm` submits one job per sweep point."""
    cmd = [sys.executable, "-m", "stem_megatron.train", "-m", "hydra/launcher=slurm", f"hydra.sweep.dir={tmp_path}",
           "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=10",
           *tiny(corpus, tmp_path / "run-${stem.variant}", 3, parallel="single"), "variant=dense,stem_full"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for variant, ratio in (("dense", "0"), ("stem", "full")):
        run = tmp_path / f"run-{variant}"
        assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
        assert json.loads((run / "config.json").read_text())["stem"]["ratio"] == ratio


def test_preprocess_array_then_merge_equals_one_process(slurm, corpus, tmp_path):
    """slurm/preprocess.sh as a two-task array (each task its share, --shard from the array), then --merge: the
    bytes one process writes; the log names the task and its CPUs. (The merge job is the same script without
    --array: here in this process, a job less.)"""
    from stem_megatron.data.preprocess import merge, preprocess

    docs = [" ".join(["def", "naïve", "x"] * (i % 17 + 1)) for i in range(120)]
    (tmp_path / "in").mkdir()
    for i in range(4):
        (tmp_path / "in" / f"{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[i::4]))
    args = ["--input", str(tmp_path / "in"), "--tokenizer", str(corpus / "tokenizer.json")]
    script = REPO / "slurm" / "preprocess.sh"
    array = submit(tmp_path, "--wait", "--array=0-1", "--cpus-per-task=1", "--time=5", str(script), *args,
                   "--output-prefix", str(tmp_path / "tok" / "train"), timeout=180)
    logs = sorted((tmp_path / "logs").glob("preprocess-*.out"))
    assert array.returncode == 0, "\n".join(log.read_text()[-2000:] for log in logs)
    assert sorted(log.read_text().splitlines()[0].split(" on ")[0] for log in logs) == [
        "preprocess: task 0 of 2", "preprocess: task 1 of 2"]
    assert merge(tmp_path / "tok" / "train")["shards"] == 2
    preprocess([tmp_path / "in"], tmp_path / "one" / "train", corpus / "tokenizer.json")
    for suffix in (".bin", ".idx"):
        assert (tmp_path / "tok" / f"train{suffix}").read_bytes() == (tmp_path / "one" / f"train{suffix}").read_bytes()
