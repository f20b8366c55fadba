"""Stopping on a signal (training/preemption.py): SIGTERM or SIGUSR1 mid-run finishes the step in flight, every rank
saves at the step they agreed on, and the rerun redoes no step: losses, grad norms, LR and every weight and table
row bitwise those of an uninterrupted run. One process, TP=2 under torchrun, and two emulated nodes with the signal
sent to one node's agent only. A second signal or the deadline exits at once; saves by time land on one step on
every rank. The SLURM path (the job script forwards SIGUSR1, the job is requeued): tests/test_slurm.py."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from runs import STEPS, Run, overrides_of, train
from torch.distributed.elastic.utils.distributed import get_free_port

LOG = 2  # the stopped run's train.log_interval: a signal is sent once its first step line is written


def _cmd(corpus, out_dir, parallel, nnodes=1, nproc=1, *overrides):
    train = ["-m", "stem_megatron.train", *overrides_of(corpus, out_dir, f"parallel={parallel}",
                                                        f"train.log_interval={LOG}", *overrides)]
    if parallel == "single":
        return [sys.executable, *train]
    return [sys.executable, "-m", "stem_megatron.torchrun", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{get_free_port()}", "--rdzv_id=stem-stop", *train]


def _start(cmd):
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(agents, codes):
    outputs = [agent.communicate(timeout=600) for agent in agents]
    for agent, code, (out, err) in zip(agents, codes, outputs):
        assert agent.returncode == code, f"exit {agent.returncode}, not {code}\n{out[-2000:]}\n{err[-4000:]}"
    return "".join(out for out, _ in outputs), "".join(err for _, err in outputs)


def _logged(out_dir) -> int:
    metrics = Path(out_dir) / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _workers(agent) -> list[int]:
    """The training processes a torchrun agent started (its child processes)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == agent.pid:
            children.append(int(stat.parent.name))
    return children


def _stop_and_resume(runs, tmp_path, parallel, nnodes, nproc, sig, target):
    """The same run as the uninterrupted one, launched and sent ``sig`` once its first logged step (2) is written;
    its rerun."""
    corpus, out = runs.corpus, tmp_path / "stopped"
    straight = runs.shared(f"parallel={parallel}", nodes=nnodes, nproc=nproc)
    cmd = _cmd(corpus, out, parallel, nnodes, nproc)  # the nodes of one run meet at one rendezvous port
    agents = [_start(cmd) for _ in range(nnodes)]
    deadline = time.monotonic() + 300
    while _logged(out) < 1 and time.monotonic() < deadline and all(a.poll() is None for a in agents):
        time.sleep(0.05)
    codes = [0] * nnodes
    if target == "worker of node 0":  # as SLURM signals every process of a job step, here one node's only
        for pid in _workers(agents[0]):
            os.kill(pid, sig)
    else:  # the process, or the agent, which passes it on and says so in its status
        agents[0].send_signal(sig)
        codes[0] = 0 if target == "process" else 128 + sig
    stdout, _ = _finish(agents, codes)
    # the operator's view (training/run_summary.py) at start and in a step line
    assert f"layout: {nnodes} node(s) x {nproc} CPU rank(s)" in stdout and "\nmemory plan: " in stdout
    assert re.search(rf"\nstep +{LOG}/{STEPS} .* tokens/s \d+  mem [\d.]+ GiB  eta \d+m\d\ds\n", stdout), stdout
    stopped = json.loads((out / "stopped.json").read_text())
    step = stopped["step"]
    assert LOG <= step < STEPS and stopped["signal"] == sig.name, stopped
    assert f"stopped after step {step} on {sig.name}" in stdout
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{step:06d}"
    assert Run(out).metrics[-1]["step"] == step  # the stop's step is logged although not a 2nd one
    assert not (out / "export").exists()

    cmd = _cmd(corpus, out, parallel, nnodes, nproc)
    rerun = [_start(cmd) for _ in range(nnodes)]
    stdout, stderr = _finish(rerun, [0] * nnodes)
    assert f"after step {step}" in stdout and not (out / "stopped.json").exists()
    assert "Warning" not in stderr, stderr  # torch's notices on megatron's checkpoint load: quiet.py
    a, b = straight.metrics, Run(out).metrics
    assert [r["step"] for r in b] == sorted({*range(LOG, STEPS + 1, LOG), step}), "a step was redone or skipped"
    by_step = {r["step"]: r for r in a}
    for r in b:
        if r["step"] in by_step:
            for key in ("loss", "grad_norm", "lr"):
                assert r[key] == by_step[r["step"]][key], (r["step"], key)
    wa, wb = straight.weights(), Run(out).weights()
    assert wa.keys() == wb.keys() and any(".U_l." in k for k in wa)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("parallel,nnodes,nproc,sig,target", [
    ("single", 1, 1, signal.SIGTERM, "process"),
    ("tp2", 1, 2, signal.SIGTERM, "agent"),
    ("dp2", 2, 1, signal.SIGUSR1, "worker of node 0"),  # node 1's rank learns of it from the all-reduce
])
def test_a_signal_mid_run_saves_where_every_rank_agrees_and_the_rerun_redoes_no_step(
        runs, tmp_path, parallel, nnodes, nproc, sig, target):
    """Stopped under the launcher it names, the run resumes bitwise as the uninterrupted one (tests/runs.py's, the
    same run without the launcher: torchrun changes no bit)."""
    _stop_and_resume(runs, tmp_path, parallel, nnodes, nproc, sig, target)


def _signals_script(deadline_s: float, second_after_s: float) -> list[str]:
    """A process that gets SIGTERM, the same again at once (torchrun passing SLURM's on), then a second one."""
    return [sys.executable, "-c", textwrap.dedent(f"""
        import os, signal, time
        from stem_megatron.training.preemption import StopSignals
        with StopSignals({deadline_s}) as signals:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
            print("caught", signals.received.name, flush=True)
            time.sleep({second_after_s})
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        """)]


@pytest.mark.parametrize("deadline_s,second_after_s,why", [(60, 2.5, "a second signal"),
                                                           (1.5, 60, "train.stop_deadline_s")])
def test_a_second_signal_or_the_deadline_exits_at_once(deadline_s, second_after_s, why):
    start = time.monotonic()
    proc = subprocess.run(_signals_script(deadline_s, second_after_s), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert proc.stdout.strip() == "caught SIGTERM"  # the repeat 0.1 s later did not count as a second signal
    assert f"stopping at once ({why} after SIGTERM)" in proc.stderr
    assert time.monotonic() - start < min(deadline_s, second_after_s) + 15


@pytest.mark.slow
def test_saves_by_time_land_on_one_step(runs, tmp_path):
    """``checkpoint.save_interval_min`` tiny: due after every step, agreed one step later, so steps 2-4 save (the
    decision of step 1's end arrives at step 2's), and no step saves twice (step 4 is also due by its interval)."""
    run = train(runs.corpus, tmp_path, "parallel=dp2", "train.steps=4", "checkpoint.save_interval_min=1e-6", nproc=2)
    saved = [line.rsplit("/", 1)[-1] for line in run.stdout.splitlines() if line.startswith("saved checkpoint")]
    assert saved == ["step_000002", "step_000003", "step_000004"], run.stdout


def test_a_signal_and_a_save_due_reach_every_rank_at_the_next_step_s_decision(world_of_one, capsys):
    """In the pytest process, a world of one: what a rank sends at a step's end is the decision at the next step's;
    the first decision after a signal says it once (rank 0); the handlers are the process' again after the run."""
    import torch.distributed as dist

    from stem_megatron.training.preemption import Decision, StopSignals

    before = signal.getsignal(signal.SIGUSR1)
    with StopSignals(60, dist.new_group(backend="gloo")) as signals:
        assert signals.decided() == Decision()  # nothing sent before the first step
        signals.send(save_due=True)
        assert signals.decided() == Decision(save_due=True)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert signals.decided() == Decision()  # the signal came after this step's exchange was sent
        signals.send(save_due=False)
        assert signals.decided() == Decision(stop=signal.SIGUSR1)
        signals.send(save_due=False)
    assert signal.getsignal(signal.SIGUSR1) is before
    assert capsys.readouterr().out.count("SIGUSR1: finishing the step in flight, then a checkpoint and stop") == 1
