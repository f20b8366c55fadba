"""A run never resumes a stranger: the default run directory carries a digest of what decides the training,
and each job of a Hydra sweep runs in its own directory under the sweep's; the same command (a requeue or
a rerun) still resumes its own run."""

import json
import subprocess
import sys

import pytest
from conftest import VOCAB

SMALL = ["model.num_layers=2", "model.seq_length=32", f"model.vocab_size={VOCAB}", f"data.vocab_size={VOCAB}",
         "train.steps=3", "train.micro_batch_size=2", "train.global_batch_size=4"]


def _stem_train(cwd, *args, nproc=None):
    launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}"] if nproc else []
    proc = subprocess.run([sys.executable, *launcher, "-m", "stem_megatron.train", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def _first_steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()][:1]


@pytest.mark.slow
def test_a_sweep_after_the_demo_starts_every_job_from_step_one(corpus, tmp_path):
    """The README's demo (TP=2) and then a ratio sweep on one process, from the same directory: the sweep
    does not pick up the demo's checkpoint, and rerunning the demo's command resumes the demo."""
    data = f"data.dir={corpus}"
    demo = _stem_train(tmp_path, *SMALL, data, nproc=2)
    demo_dir = tmp_path / demo.split("run directory: ", 1)[1].splitlines()[0]
    assert demo_dir.name.startswith("tiny-stem-1_3-") and _first_steps(demo_dir) == [1]
    sweep = _stem_train(tmp_path, "-m", "stem.ratio=1/3,full", "parallel=single", *SMALL, data)
    assert "resumed from" not in sweep
    jobs = sorted(p for p in (tmp_path / "runs" / "multirun").glob("*/*") if (p / "metrics.jsonl").exists())
    assert [job.name for job in jobs] == ["0", "1"]
    assert all(_first_steps(job) == [1] for job in jobs)
    again = _stem_train(tmp_path, *SMALL, data, nproc=2)
    assert f"resumed from {demo_dir.relative_to(tmp_path)}/checkpoints/step_000003 after step 3" in again


def test_fields_added_since_keep_a_runs_directory_and_a_hf_start_gets_its_own():
    """The fields added later (``model.qkv_bias``, ``model.rope_scaling_factor``, ``stem.calibration_tokens``) at
    their defaults leave a run the directory it had before them (the names below, from the version before), so the
    same command still resumes it; set, as a run started from a Hugging Face model, they name another."""
    from stem_megatron.recipes import compose_run

    before = {(): "runs/tiny-stem-1_3-48c69674", ("variant=dense", "parallel=single"): "runs/tiny-dense-0-b64bd457",
              ("checkpoint.init_from=/x",): "runs/tiny-stem-1_3-063ac017"}
    for overrides, out_dir in before.items():
        assert compose_run(list(overrides)).out_dir == out_dir
    others = {compose_run([override]).out_dir for override in
              ("checkpoint.init_from_hf=/x", "checkpoint.init_from_hf=/y", "model.qkv_bias=true",
               "stem.calibration_tokens=1000")}
    assert len(others) == 4 and not others & set(before.values())
