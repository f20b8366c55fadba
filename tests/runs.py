"""Training runs for the tests: ``stem-train`` in forkserver workers, one set of sizes, finished runs shared.

A test that compares runs (layouts, nodes, resume, overlap, working sets) needs the training loop, not the launcher:
``train`` runs ``stem-train``'s own function (``stem_megatron.train.train``, what Hydra's main calls) in workers
forked from ``tests/distributed.py``'s forkserver, which imported torch, megatron-core and our code once a session.
Each worker gets the environment torchrun gives a rank: ``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and its
agent's node, ``GROUP_RANK`` (ranks node by node, as the c10d rendezvous numbers them), so several nodes are
emulated as several torchrun agents emulate them. A torchrun rank first pays ~9 s of imports; a forked one none.
Where the launcher is the subject (signals and preemption, killed saves, the CLI's errors, the demo, SLURM) tests
launch ``torchrun`` themselves, with ``overrides_of``.

Every run starts from ``BASE`` (STEM-1/3, 3 layers, ``STEPS`` steps of ``GLOBAL`` sequences, validated and saved
every 4 steps, exported at the end), so a straight run that several tests compare against is one run:
``Runs.shared`` trains it at its first request of the session, keyed by the config it composes and its layout; tests
read it and never write to it (``copy_stopped`` copies it as a run stopped at one of its saves would have left it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp
from conftest import VOCAB
from torch.distributed.elastic.utils.distributed import get_free_port

import distributed  # noqa: F401 - sets the forkserver's preload before the first worker is forked

STEPS, MICRO, GLOBAL = 8, 2, 8  # 8 steps of 8 sequences of 32 tokens: DP up to 4
BASE = ("variant=stem_1_3", "model.num_layers=3", "model.seq_length=32", f"model.vocab_size={VOCAB}",
        f"data.vocab_size={VOCAB}", f"train.steps={STEPS}", f"train.micro_batch_size={MICRO}",
        f"train.global_batch_size={GLOBAL}", "train.eval_interval=4", "train.eval_iters=1",
        "checkpoint.save_interval=4", "checkpoint.export=${out_dir}/export")
TIMEOUT_S = 600  # a launch that has not ended by then is stopped, and its test fails with every rank's output
CRASHED = 3  # a worker's exit code where an exception escaped stem-train's own handling (its traceback on stderr)


@dataclass
class Run:
    """A finished launch: its directory, its exit code, what rank 0 printed and what every rank reported."""

    out_dir: Path
    returncode: int = 0
    stdout: str = ""
    stderr: str = ""

    @property
    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.out_dir / "metrics.jsonl").read_text().splitlines()]

    def weights(self) -> dict[str, torch.Tensor]:
        """The export's weights (``checkpoint.export``)."""
        return torch.load(self.out_dir / "export" / "model.pt", weights_only=True)["weights"]


def overrides_of(corpus, out_dir, *overrides) -> list[str]:
    """``BASE``, the corpus and ``out_dir``, then ``overrides``: what ``stem-train`` is given."""
    return [*BASE, f"data.dir={corpus}", f"out_dir={out_dir}", *overrides]


def _rank(rank, env, world, nproc, port, overrides, logs):
    """One rank, as torchrun would start it on node ``rank // nproc``, its output in ``logs``: ``stem-train``'s
    function on the composed recipe, so a bad input ends it as the command ends (one line, exit code 1)."""
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank % nproc), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK=str(rank // nproc), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    for fd, name in ((1, "out"), (2, "err")):
        os.dup2(os.open(os.path.join(logs, f"{rank}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1
    from hydra import compose, initialize_config_dir

    from stem_megatron.recipes import RECIPES
    from stem_megatron.train import train

    code = 0
    try:
        with initialize_config_dir(config_dir=RECIPES, version_base=None):
            cfg = compose("train", overrides=overrides)
        train(cfg)
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = CRASHED
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)  # torch's worker wrapper passes SystemExit on: the code is the process'


def train(corpus, out_dir, *overrides, nodes: int = 1, nproc: int = 1, check: bool = True) -> Run:
    """``stem-train`` on ``nodes`` x ``nproc`` ranks (``BASE``, then ``overrides``) into ``out_dir``. ``check``: a
    rank that fails fails the test, with every rank's output; else its exit code is the run's. A rendezvous port
    taken between ``get_free_port`` and rank 0's bind (the other pytest worker's launch) is tried again, twice."""
    args = overrides_of(corpus, out_dir, *overrides)
    world = nodes * nproc
    for _ in range(3):
        codes, said = _launch(args, world, nproc)
        if not (codes[0] and "EADDRINUSE" in said[0, "err"]):
            break
    if check and any(codes):
        tail = "".join(f"--- rank {r} {n}:\n{text[-3000:]}" for (r, n), text in said.items())
        raise AssertionError(f"stem-train {' '.join(overrides)} on {nodes} x {nproc}: exit codes {codes}\n{tail}")
    stderr = "".join(said[r, "err"] for r in range(world))
    return Run(Path(out_dir), next((c for c in codes if c), 0), said[0, "out"], stderr)


def _launch(args: list, world: int, nproc: int) -> tuple[list, dict]:
    """Every rank's exit code and its stdout and stderr (``(rank, "out" | "err")``)."""
    with tempfile.TemporaryDirectory() as logs:
        context = mp.start_processes(_rank, args=(dict(os.environ), world, nproc, get_free_port(), args, logs),
                                     nprocs=world, join=False, start_method="forkserver")
        deadline = time.monotonic() + TIMEOUT_S
        while not all(p.exitcode is not None for p in context.processes) and time.monotonic() < deadline:
            if any(p.exitcode for p in context.processes):  # one failed: the others may wait for it forever
                deadline = min(deadline, time.monotonic() + 30)
            time.sleep(0.05)
        for p in context.processes:
            if p.exitcode is None:
                p.kill()
            p.join()
        said = {(r, n): Path(logs, f"{r}.{n}").read_text() for r in range(world) for n in ("out", "err")}
    return [p.exitcode for p in context.processes], said


def copy_stopped(run: Run, step: int, copy: Path) -> Run:
    """``copy``: ``run`` as a run stopped after its save at ``step`` would have left it (no later checkpoint, no
    export, ``latest`` naming ``step``). Its later metrics stay: a resumed run drops those after its checkpoint."""
    shutil.copytree(run.out_dir, copy, ignore=shutil.ignore_patterns("export"), dirs_exist_ok=True)
    root = copy / "checkpoints"
    for later in root.glob("step_*"):
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)
    (root / "latest").write_text(f"step_{step:06d}\n")
    return Run(copy)


class Runs:
    """The session's finished runs, one directory each under ``root``, which tests read and never write."""

    def __init__(self, corpus, root: Path):
        self.corpus, self.root, self._done = corpus, root, {}

    def shared(self, *overrides, nodes: int = 1, nproc: int = 1) -> Run:
        """The run of ``overrides`` at ``nodes`` x ``nproc``, trained at its first request. Its key is the config the
        overrides compose (a default spelt out or not, ``parallel=dp2`` or ``single``) and the layout."""
        from stem_megatron.recipes import compose_run

        cfg = compose_run(overrides_of(self.corpus, "/out", *overrides))
        key = (json.dumps(dataclasses.asdict(cfg), sort_keys=True), nodes, nproc)
        if key not in self._done:
            self._done[key] = train(self.corpus, self.root / f"run{len(self._done)}", *overrides, nodes=nodes,
                                    nproc=nproc)
        return self._done[key]
