#!/usr/bin/env python3
"""Golden losses: the tiny model's step losses recorded on the CPU, rerun on a GPU and compared within bf16's reach.

Three configs (``CONFIGS``), one process each (TP = PP = DP = 1), ``STEPS`` steps of 8 x 32 tokens from a corpus this
module writes (``write_corpus``: synthetic text, seeded, tokenized by the project's pipeline; byte-identical run to
run): dense, STEM-1/3 with host tables, and STEM-1/3 with a working set of ``RESIDENT_ROWS`` rows on the device. Each
starts from a checkpoint written by a one-step CPU job (``checkpoint.init_from``, as stem-doctor's comparison does):
a GPU run draws its first weights from the CUDA generator, so without it the runs would differ by their
initialisation, not by their arithmetic.

``--record`` trains them on the CPU (fp32; bitwise reproducible) and writes ``tests/golden_losses.json``: each step's
loss and grad norm as metrics.jsonl has them, the overrides, the versions and the date. ``tests/test_golden_losses.py``
reruns them on the CPU and asks for the recorded floats exactly, so a change that moves the CPU losses fails it until
it is re-recorded. ``--check`` (a GPU machine) trains them on the GPU (bf16) with torch's deterministic algorithms
and cuBLAS' fixed workspace, and compares: every step within ``MAX_ABS`` of the recording and the mean within
``MEAN_ABS`` (docs/gpu.md, "Golden losses", says why); ``OUT/golden_losses.log`` gets the per-step table.

Run: ``.venv/bin/python tools/golden_losses.py --record`` (CPU, about a minute on 2 cores) or
``.venv/bin/python tools/golden_losses.py --check --out DIR`` (exit 0: every config within the tolerance, 1: not,
2: no GPU here).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.process_tree import confined, take_charge  # noqa: E402
from stem_megatron.setup_check import require_environment  # noqa: E402

require_environment()  # before anything else: another Python gets `make setup`, not a traceback

RECORDING = REPO / "tests" / "golden_losses.json"
FORMAT = "stem-megatron-golden-losses-v1"
RECORD_COMMAND = ".venv/bin/python tools/golden_losses.py --record"
VOCAB, STEPS, RESIDENT_ROWS = 1024, 30, 160
MAX_ABS, MEAN_ABS = 0.05, 0.02  # GPU (bf16) against the CPU recording (fp32): any step, and the mean over the steps
RUN_TIMEOUT_S = 300  # runs launched together (the init jobs, then the configs) are stopped after this
GRACE_S = 20
# every value runs.BASE (tests/runs.py) sets, and what it leaves to train.yaml, given here: the CPU test's forked
# runs (BASE, then these) and this module's torchrun runs (these alone) compose one config
COMMON = ("parallel=single", "model.num_layers=3", "model.seq_length=32", f"model.vocab_size={VOCAB}",
          f"data.vocab_size={VOCAB}", f"train.steps={STEPS}", "train.micro_batch_size=4", "train.global_batch_size=8",
          "train.eval_interval=0", "train.eval_iters=0", "train.log_interval=1", "checkpoint.save=false",
          "checkpoint.save_interval=0", "checkpoint.export=null", "checkpoint.resume=false")
INITS = {"dense": ("variant=dense",), "stem_1_3": ("variant=stem_1_3", "host_tables.placement=host")}
CONFIGS = {  # name -> (the init it starts from, its overrides after COMMON)
    "dense": ("dense", ("variant=dense",)),
    "stem_1_3_host": ("stem_1_3", ("variant=stem_1_3", "host_tables.placement=host")),
    "stem_1_3_working_set": ("stem_1_3", ("variant=stem_1_3", "host_tables.placement=host",
                                          f"host_tables.resident_rows={RESIDENT_ROWS}")),
}
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # cuBLAS' reproducible workspace, asked for by torch
                     "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}  # Transformer Engine's attention, where installed


# ---------------------------------------------------------------- the corpus
ANSWERS = ("north", "south", "east", "west", "river", "stone", "harbour", "valley", "forest", "island")
FILLER = "the heap queue sorts tuples by key; def f(x): return x ** 2 # a comment".split()
SYLLABLES = ("ar", "bel", "cor", "dun", "el", "fen", "gar", "hol", "is", "jor", "kes", "lun", "mar", "nor", "os",
             "pel", "qua", "ril", "sar", "tol", "ul", "ven", "wik", "yor", "zan")


def corpus_documents(seed: int = 0) -> list[str]:
    """Forty short documents from ``seed``: facts ("The capital of X is Y.", one answer for each of 200 made-up
    subjects), small functions and filler words; what a tiny model learns some of in a few dozen steps."""
    rng = random.Random(seed)
    subjects = sorted({"".join(rng.choices(SYLLABLES, k=rng.randint(2, 3))).capitalize() for _ in range(200)})
    answer = {x: rng.choice(ANSWERS) for x in subjects}
    docs = []
    for d in range(40):
        lines = [f"Section {d}"]
        for _ in range(40):
            kind = rng.random()
            if kind < 0.5:
                x = rng.choice(subjects)
                lines.append(f"The capital of {x} is {answer[x]}.")
            elif kind < 0.75:
                a, b = rng.randint(1, 99), rng.randint(1, 9)
                lines.append(f"def {rng.choice(subjects).lower()}(x): return x * {b} + {a}")
            else:
                lines.append(" ".join(rng.choices(FILLER, k=rng.randint(4, 10))))
        docs.append("\n".join(lines) + "\n")
    return docs


def write_corpus(out: Path) -> Path:
    """``out/corpus``: tokenizer.json (byte-level BPE of ``VOCAB`` ids) and train/valid indexed datasets of
    ``corpus_documents``, by the demo corpus' pipeline (``data/corpus.py``); the same bytes on every run."""
    from stem_megatron.data.corpus import prepare_corpus

    sources = out / "sources"
    sources.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(corpus_documents()):
        (sources / f"doc{i:02d}.txt").write_text(doc, encoding="utf-8")
    prepare_corpus(out / "corpus", vocab_size=VOCAB, valid_fraction=0.1, source_dir=sources)
    return out / "corpus"


# ---------------------------------------------------------------- the runs
def init_overrides(init: str) -> list[str]:
    """The one-step CPU job whose checkpoint the configs that name ``init`` start from."""
    return [*COMMON, *INITS[init], "train.steps=1", "checkpoint.save=true"]


def run_overrides(name: str, init_checkpoints: Path) -> list[str]:
    """Config ``name``'s overrides, starting from the checkpoints of its init job."""
    return [*COMMON, *CONFIGS[name][1], f"checkpoint.init_from={init_checkpoints}"]


def launch_all(jobs: dict[str, list[str]], work: Path, env: dict[str, str], worker: bool = False) -> dict[str, int]:
    """Each job (name -> overrides) as ``torchrun --nproc_per_node 1`` into ``work/name``, all side by side, its
    output in ``work/name.log``; ``worker``: through this module's ``--worker`` (deterministic algorithms). Exit
    codes by name (-1: stopped at ``RUN_TIMEOUT_S``)."""
    entry = [str(Path(__file__).resolve()), "--worker"] if worker else ["-m", "stem_megatron.train"]
    procs, codes = {}, {}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    with confined(GRACE_S):
        for name, overrides in jobs.items():
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", *entry,
                   *overrides, f"out_dir={work / name}"]
            with open(work / f"{name}.log", "w") as log:
                log.write(" ".join(cmd) + "\n")
                log.flush()
                procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        for name, proc in procs.items():
            try:
                codes[name] = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = -1  # confined's end stops it and what it started
    return codes


def metrics(out_dir: Path) -> dict[str, list]:
    """A run's per-step ``loss`` and ``grad_norm`` from its metrics.jsonl, as JSON gives them."""
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"loss": [r["loss"] for r in records], "grad_norm": [r.get("grad_norm") for r in records]}


def train_configs(work: Path, gpu: bool) -> dict[str, dict]:
    """The init jobs on the CPU, then every config (on the GPU with ``gpu``) from them; each config's metrics.
    A failed run raises with its log's last lines."""
    corpus = write_corpus(work)
    cpu_env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    inits = {f"init_{init}": [*init_overrides(init), f"data.dir={corpus}"] for init in INITS}
    _require(launch_all(inits, work, cpu_env), work)
    jobs = {name: [*run_overrides(name, work / f"init_{init}" / "checkpoints"), f"data.dir={corpus}"]
            for name, (init, _) in CONFIGS.items()}
    env = {**os.environ, **DETERMINISTIC_ENV} if gpu else cpu_env
    _require(launch_all(jobs, work, env, worker=gpu), work)
    return {name: metrics(work / name) for name in CONFIGS}


def _require(codes: dict[str, int], work: Path) -> None:
    failed = {name: code for name, code in codes.items() if code != 0}
    if failed:
        tails = "".join(f"--- {name} (exit {code}; {work / name}.log):\n"
                        + "".join((work / f"{name}.log").read_text(errors="replace").splitlines(True)[-15:])
                        for name, code in failed.items())
        raise RuntimeError(f"{', '.join(f'{name} (exit {code})' for name, code in failed.items())} failed: the "
                           f"logs' last lines follow\n{tails}")


def deterministic_worker(overrides: Sequence[str]) -> None:
    """A torchrun rank: torch's deterministic algorithms (a warning where an op has none), then stem-train."""
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    from stem_megatron import train

    sys.argv = [sys.argv[0], *overrides]
    train.main()


# ---------------------------------------------------------------- the comparison
def compare(recorded: Sequence[float], measured: Sequence[float], max_abs: float = MAX_ABS,
            mean_abs: float = MEAN_ABS) -> tuple[list[str], Optional[float], Optional[float]]:
    """(problems, max |dloss|, mean |dloss|) of ``measured`` against ``recorded`` step by step: a step missing from
    either, a non-finite loss, a step beyond ``max_abs`` or a mean beyond ``mean_abs`` is a problem."""
    problems = []
    if len(measured) != len(recorded):
        problems.append(f"{len(measured)} steps measured, {len(recorded)} recorded")
    pairs = list(zip(recorded, measured))
    bad = [step for step, (r, m) in enumerate(pairs, 1) if not (math.isfinite(r) and math.isfinite(m))]
    if bad:
        problems.append(f"non-finite loss at step(s) {', '.join(map(str, bad))}")
    if not pairs or bad:
        return problems, None, None
    deltas = [abs(m - r) for r, m in pairs]
    worst, mean = max(deltas), sum(deltas) / len(deltas)
    if worst > max_abs:
        step = deltas.index(worst) + 1
        problems.append(f"step {step}: |dloss| {worst:.4f} > {max_abs} (recorded {pairs[step - 1][0]:.4f}, "
                        f"measured {pairs[step - 1][1]:.4f})")
    if mean > mean_abs:
        problems.append(f"mean |dloss| {mean:.4f} > {mean_abs}")
    return problems, worst, mean


def summary_line(name: str, steps: int, problems: list[str], worst: Optional[float], mean: Optional[float]) -> str:
    """``golden <name>: <steps> steps, max |dloss| a <= MAX_ABS, mean |dloss| b <= MEAN_ABS, ok`` (or FAIL: why)."""
    figures = "" if worst is None else (f", max |dloss| {worst:.4f} <= {MAX_ABS}, mean |dloss| {mean:.4f} <= "
                                        f"{MEAN_ABS}")
    return f"golden {name}: {steps} steps{figures}, " + ("ok" if not problems else "FAIL: " + "; ".join(problems))


def table(name: str, recorded: dict, measured: dict) -> str:
    """Per step: the recorded (CPU) and measured loss, their difference, and both grad norms."""
    lines = [f"{name}:", f"  {'step':>4}  {'CPU loss':>10}  {'GPU loss':>10}  {'dloss':>9}  {'CPU |g|':>9}  "
                         f"{'GPU |g|':>9}"]
    for i in range(max(len(recorded["loss"]), len(measured["loss"]))):
        r, m = ([run[key][i] if i < len(run[key]) else None for key in ("loss", "grad_norm")]
                for run in (recorded, measured))
        delta = "-" if r[0] is None or m[0] is None else f"{m[0] - r[0]:+.5f}"
        cells = ["-" if x is None else f"{x:.6f}" for x in (r[0], m[0])]
        norms = ["-" if x is None else f"{x:.4f}" for x in (r[1], m[1])]
        lines.append(f"  {i + 1:>4}  {cells[0]:>10}  {cells[1]:>10}  {delta:>9}  {norms[0]:>9}  {norms[1]:>9}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- record and check
def versions() -> dict[str, str]:
    """torch's and megatron-core's versions (the installed distributions': megatron's ``__version__`` appends the
    commit of the git checkout around it) and the CPU kernels torch picked (AVX2, AVX512: their fp32 results
    differ in the last bits)."""
    import torch

    return {"torch": torch.__version__, "megatron_core": metadata.version("megatron-core"),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def record(work: Path) -> dict:
    """Train the configs on the CPU and write ``RECORDING``."""
    measured = train_configs(work, gpu=False)
    data = {"format": FORMAT, "date": str(datetime.date.today()), **versions(),
            "note": f"CPU, fp32, one process, OMP_NUM_THREADS=1; re-record: {RECORD_COMMAND}",
            "paths_added_at_run_time": ["data.dir", "out_dir", "checkpoint.init_from"],
            "inits": {init: init_overrides(init) for init in INITS},
            "configs": {name: {"init": CONFIGS[name][0], "overrides": [*COMMON, *CONFIGS[name][1]], **measured[name]}
                        for name in CONFIGS}}
    RECORDING.write_text(json.dumps(data, indent=1) + "\n")
    return data


def check(work: Path, out: Path) -> int:
    """Train the configs on the GPU, compare with ``RECORDING``, write ``out/golden_losses.log``; 0 or 1."""
    recording, here = json.loads(RECORDING.read_text()), versions()
    with open(out / "golden_losses.log", "w") as log:
        log.write(f"golden losses {datetime.datetime.now():%Y-%m-%d %H:%M}: GPU runs (torch {here['torch']}, "
                  f"megatron-core {here['megatron_core']}) against the CPU recording of "
                  f"{recording['date']} (torch {recording['torch']}, megatron-core {recording['megatron_core']}); "
                  f"tolerance: every step's |dloss| <= {MAX_ABS}, their mean <= {MEAN_ABS}\n\n")
        try:
            measured = train_configs(work, gpu=True)
        except RuntimeError as e:
            print(f"golden: FAIL: {str(e).splitlines()[0]} ({out / 'golden_losses.log'})", flush=True)
            log.write(f"{e}\n")
            return 1
        failed = False
        for name in CONFIGS:
            recorded, gpu = recording["configs"][name], measured[name]
            problems, worst, mean = compare(recorded["loss"], gpu["loss"])
            line = summary_line(name, len(gpu["loss"]), problems, worst, mean)
            print(line, flush=True)
            log.write(line + "\n" + table(name, recorded, gpu) + "\n")
            failed |= bool(problems)
    return 1 if failed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        deterministic_worker(argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", action="store_true", help=f"train on the CPU and rewrite {RECORDING.name}")
    mode.add_argument("--check", action="store_true", help="train on the GPU and compare with the recording")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "golden-losses", help="--check: the log's folder")
    ap.add_argument("--work", type=Path, default=None, help="the corpus and runs (default: a temporary folder)")
    args = ap.parse_args(argv)
    if args.check:
        import torch

        if not torch.cuda.is_available():
            print("golden losses: --check needs a GPU and torch sees none here (record on the CPU with --record)",
                  file=sys.stderr)
            return 2
        args.out.mkdir(parents=True, exist_ok=True)
    take_charge()  # the runs' orphans come here, and a SIGTERM ends their processes first
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.record:
            try:
                data = record(work)
            except RuntimeError as e:
                print(f"golden: {e}", file=sys.stderr)
                return 1
            for name, config in data["configs"].items():
                print(f"golden {name}: {len(config['loss'])} steps recorded, loss {config['loss'][0]:.4f} -> "
                      f"{config['loss'][-1]:.4f}")
            print(f"wrote {RECORDING}")
            return 0
        return check(work, args.out)


if __name__ == "__main__":
    sys.exit(main())
