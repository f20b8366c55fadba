"""Training steps of dense and STEM variants side by side on this machine's device.

Per model, a few steps of each variant, each a `stem-train` run of its own (torchrun, one subprocess per variant,
so a variant that runs out of memory does not take the others with it):

  dense                 variant=dense
  stem_1_3_device       STEM-1/3, tables on the device (host_tables.placement=device; host_tables.clip=global, which
                        device tables need)
  stem_1_3_host_lazy    STEM-1/3, tables in host memory, CPU Adam on the touched rows (host_tables.optimizer=lazy)
  stem_1_3_host_dense   STEM-1/3, tables in host memory, CPU Adam on every row (host_tables.optimizer=dense, the
                        paper recipes' setting)
  stem_full_host        STEM-full, tables in host memory, the recipe's CPU Adam
  stem_1_3_resident_lazy  STEM-1/3, host tables with a working set of 16,384 rows a layer on the device, updated
                        there (host_tables.resident_rows, lazy Adam; docs/gpu_step_v2.md)
  stem_full_resident_lazy STEM-full, the same with 12,288 rows a layer (two steps' rows, ~9.2k, and room; at 1B
                        its 16 layers plan 55.3 GiB with it, 60.9 GiB with 16,384)
  stem_1_3_resident_dense STEM-1/3 with that working set and CPU Adam on every row (the recipe's dense Adam: the
                        rows not resident decayed on the host)
  stem_1_3_resident_fit STEM-1/3 with lazy Adam and the largest working set whose memory plan stays within dense's
                        + 10% (the peak goal, docs/gpu.md; `flops/memory.working_set_within` at the profile's
                        distinct ids: 8,947 rows a layer at 1B, 8,003 at 350M on one GPU)

Shapes: `paper` (default with a GPU): +experiment=pretrain_350m and +experiment=pretrain_1b at sequence length
2048, global batch 16 (32,768 tokens per step), micro-batch 4 (350M) and 2 (1B), and `1B-3L`, the 1B recipe with 3
of its 16 layers (its widths and vocabulary: a STEM layer's cost against a dense one's, with one or two layers'
tables to build; `tools/gpu_check.py`'s ratios); `tiny` (default without one):
model=tiny, 16 x 128 tokens per step, micro-batch 8. Token ids are drawn from the 128k-vocabulary profile
(benchmarks/data/token_counts_128k.npy): its V-1 most frequent ids, renumbered 1..V-1 in their order, for a model
of vocabulary V (id 0 is EOD); the documents are written as an indexed dataset by stem-preprocess's writer
(`data/preprocess.py`) through a word-level tokenizer over those ids, under `--out`.

Per variant one table row: median step time over the steps after `--warmup` (the profiled last step left out),
tokens/s, MFU (`flops/mfu.py`; none on CPU), peak memory (GPU: torch.cuda.max_memory_allocated of rank 0; CPU: rank
0's peak RSS), the memory plan's bytes per GPU or rank (`flops/memory.py`, at the distinct ids a micro-batch and a
step of the profile's ids are expected to hold), the step time over dense's in the same
invocation, and the STEM parts per step from metrics.jsonl (prefetch wait, CPU Adam on the step's path, the wait
for the last step's CPU Adam that ran beside it, exchange wait, bytes to and from the device, the counted peak of
row leaves and merged row gradients on the device). Then the top ops of the last step of each run, profiled by `logging.profile_step` (by self CUDA
time on a GPU and by self CPU time). No checkpoint is written (`checkpoint.save=false`).

Run: ``.venv/bin/python benchmarks/gpu_step.py [--shapes tiny|paper] [--variants dense,stem_1_3_host_lazy]
[--steps N] [--warmup N] [--nproc N] [--json out.json] [override ...]`` (extra Hydra overrides go to every run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's stem_megatron, installed or not
from stem_megatron.setup_check import require_environment  # noqa: E402

require_environment()  # before torch and megatron: another Python gets `make setup`, not a traceback

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.process_tree import confined, take_charge  # noqa: E402
from stem_megatron.data.tokenizer import EOD_TOKEN  # noqa: E402
from stem_megatron.flops.distinct import expected_distinct_ids, profile_ids  # noqa: E402
from stem_megatron.flops.memory import WITHIN_DENSE  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from row_sync import DEFAULT_COUNTS, load_counts  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GIB, MB = 2**30, 1e6
GRACE_S = 30  # a run stopped (--timeout, --until, SIGTERM): SIGTERM to its processes, then SIGKILL after this

# the working set (docs/gpu_step_v2.md: ~6.5k distinct ids a step at 32,768)
RESIDENT = "host_tables.resident_rows=16384"
RESIDENT_FULL = "host_tables.resident_rows=12288"  # every layer a STEM layer: two steps' rows and room, 6 GiB under 16k
FIT = "stem_1_3_resident_fit"  # its set sized at run time: the most rows the plan keeps within WITHIN_DENSE x dense's
VARIANTS = {  # name -> (label, overrides)
    "dense": ("dense", ["variant=dense"]),
    "stem_1_3_device": ("STEM-1/3 device tables", ["variant=stem_1_3", "host_tables.placement=device",
                                                    "host_tables.clip=global"]),
    "stem_1_3_host_lazy": ("STEM-1/3 host, lazy Adam", ["variant=stem_1_3", "host_tables.placement=host",
                                                        "host_tables.optimizer=lazy"]),
    "stem_1_3_host_dense": ("STEM-1/3 host, dense Adam", ["variant=stem_1_3", "host_tables.placement=host",
                                                          "host_tables.optimizer=dense"]),
    "stem_full_host": ("STEM-full host", ["variant=stem_full", "host_tables.placement=host"]),
    "stem_1_3_resident_lazy": ("STEM-1/3 working set, lazy", ["variant=stem_1_3", "host_tables.placement=host",
                                                               "host_tables.optimizer=lazy", RESIDENT]),
    "stem_full_resident_lazy": ("STEM-full working set, lazy", ["variant=stem_full", "host_tables.placement=host",
                                                                 "host_tables.optimizer=lazy", RESIDENT_FULL]),
    "stem_1_3_resident_dense": ("STEM-1/3 working set, dense", ["variant=stem_1_3", "host_tables.placement=host",
                                                                "host_tables.optimizer=dense", RESIDENT]),
    FIT: ("STEM-1/3 working set, fit", ["variant=stem_1_3", "host_tables.placement=host",
                                                             "host_tables.optimizer=lazy"]),
}


@dataclass(frozen=True)
class Model:
    name: str
    overrides: tuple[str, ...]
    micro_batch: int
    min_run_s: int = 60  # a run given less than this before --until would be stopped before its timed steps


@dataclass(frozen=True)
class Shapes:
    models: tuple[Model, ...]
    global_batch: int
    steps: int
    warmup: int


SHAPES = {
    "tiny": Shapes((Model("tiny", ("model=tiny", "parallel=single"), 8),), global_batch=16, steps=6, warmup=2),
    "paper": Shapes((Model("1B-3L", ("+experiment=pretrain_1b", "model.seq_length=2048", "model.num_layers=3"), 2,
                           min_run_s=30),
                     Model("350M", ("+experiment=pretrain_350m", "model.seq_length=2048"), 4),
                     Model("1B", ("+experiment=pretrain_1b", "model.seq_length=2048"), 2)),
                    global_batch=16, steps=8, warmup=3),
}
STEM_PARTS = ("stem_prefetch_wait_s", "stem_cpu_adam_s", "stem_adam_wait_s", "stem_exchange_wait_s",
              "stem_bytes_to_device", "stem_bytes_from_device", "stem_device_row_bytes_peak",
              # a working set's rows a step (each layer counted): entered, of them ahead and staged; with dense Adam
              # the rows whose decay the prefetch thread waited for, and its seconds (records only)
              "stem_rows_entered", "stem_rows_entered_ahead", "stem_rows_entered_staged", "stem_decay_rows_asked",
              "stem_decay_wait_s")


@dataclass
class Result:
    model: str
    variant: str
    label: str
    status: str = "ok"  # ok | out of memory | failed | timed out | not run (no time left before --until)
    note: str = ""
    out_dir: str = ""
    optimizer: Optional[str] = None
    steps_timed: list[int] = field(default_factory=list)
    step_time_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    mfu: Optional[float] = None
    peak_memory_bytes: Optional[int] = None
    peak_memory_kind: Optional[str] = None  # max_memory_allocated (GPU) | peak_rss (CPU)
    plan_device_bytes: Optional[int] = None
    ratio_to_dense: Optional[float] = None
    stem: dict = field(default_factory=dict)
    profile: dict = field(default_factory=dict)


# ---------------------------------------------------------------- machine
def gpu_info() -> Optional[dict]:
    """Name, memory and count of the GPUs, asked in a child process (this one never creates a CUDA context,
    which would take memory on GPU 0 from the runs); None without a GPU."""
    if not torch.cuda.is_available():
        return None
    code = ("import json, torch; p = torch.cuda.get_device_properties(0); "
            "print(json.dumps({'name': p.name, 'total_memory': p.total_memory, 'count': torch.cuda.device_count()}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None


def machine(gpu: Optional[dict]) -> str:
    cpu = f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()})"
    return f"{gpu['count']} x {gpu['name']} ({gpu['total_memory'] / GIB:.0f} GiB), {cpu}" if gpu else f"{cpu}, no GPU"


# ---------------------------------------------------------------- data
def write_corpus(out: Path, counts: np.ndarray, vocab: int, tokens: int, seed: int = 0) -> Path:
    """train/valid indexed datasets of documents whose ids follow the profile, written by stem-preprocess's writer
    through a word-level tokenizer over the ids ("t<id>"); reused while it holds at least ``tokens`` tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from stem_megatron.data.preprocess import write_indexed_dataset
    from stem_megatron.data.tokenizer import HFTokenizer

    ready = out / "READY"
    if ready.exists() and json.loads(ready.read_text()).get("tokens", 0) >= tokens:
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    words = {EOD_TOKEN: 0, **{f"t{i}": i for i in range(1, vocab)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token=EOD_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    ids, p = profile_ids(counts, vocab)
    rng = np.random.default_rng(seed)

    def documents(n_tokens: int):
        while n_tokens > 0:
            length = int(rng.integers(256, 4096))
            n_tokens -= length + 1
            yield " ".join(f"t{i}" for i in rng.choice(ids, size=length, p=p))

    hf = HFTokenizer(out / "tokenizer.json")
    written = write_indexed_dataset(documents(tokens), hf, out / "train")["tokens"]
    write_indexed_dataset(documents(8192), hf, out / "valid")
    ready.write_text(json.dumps({"vocab": vocab, "tokens": written}))
    return out


# ---------------------------------------------------------------- one run
def compose(overrides: list[str]):
    from stem_megatron.recipes import compose_run

    return compose_run(overrides)


def planned_bytes(overrides: list[str], nproc: int, gpu: bool, distinct: tuple[int, int]) -> Optional[int]:
    """The memory plan's device bytes per GPU (per rank on CPU) of rank 0's stage, as the out-of-memory line plans,
    at ``distinct`` ids of a micro-batch and a step."""
    from stem_megatron.training.device_memory import planned_device_bytes

    try:
        return planned_device_bytes(compose(overrides), 0, nproc, nproc, gpu, *distinct)
    except Exception:  # noqa: BLE001 - a layout the plan refuses: the run says why
        return None


def rows_within(overrides: list[str], nproc: int, gpu: bool, distinct: tuple[int, int]) -> int:
    """The most ``host_tables.resident_rows`` whose plan stays within ``WITHIN_DENSE`` x dense's (0: none fits)."""
    from stem_megatron.flops.memory import working_set_within
    from stem_megatron.training.device_memory import run_layout

    cfg = compose(overrides)
    return working_set_within(cfg, run_layout(cfg, nproc, nproc, gpu), WITHIN_DENSE, *distinct)


def launch(cmd: list[str], log: Path, timeout: float) -> tuple[int, str]:
    """Run ``cmd``; (exit code, stderr). At ``timeout``, or a SIGTERM to this script, it and every process it started
    (torchrun's workers, in sessions of their own) get SIGTERM, then SIGKILL after ``GRACE_S`` (``confined``)."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "w") as out, open(log.with_suffix(".err"), "w") as err, confined(GRACE_S):
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=REPO, env=env)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
    return (-1 if rc is None else rc), log.with_suffix(".err").read_text(errors="replace") + ("\n<timed out>" if
                                                                                            rc is None else "")


ERROR_LINE = re.compile(r"^(?:\[rank \d+\] )?error: (.*)$", re.M)


def failure(rc: int, stderr: str) -> tuple[str, str]:
    """(status, note) of a failed run, from stem-train's one-line errors or the last words of its output."""
    lines = ERROR_LINE.findall(stderr)
    if rc == -1:
        return "timed out", "stopped at --timeout or --until"
    oom = [line for line in lines if line.startswith("out of ")] or (
        ["torch.OutOfMemoryError"] if "OutOfMemoryError" in stderr or "CUDA out of memory" in stderr else [])
    if oom:
        return "out of memory", oom[0]
    if lines:
        return "failed", lines[0]
    tail = [line.strip() for line in stderr.splitlines() if line.strip()]
    return "failed", f"exit code {rc}" + (f": {tail[-1][:200]}" if tail else "")


def median(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def run_variant(model: Model, variant: str, args, corpus: Path, vocab: int, gpu: Optional[dict],
                distinct: tuple[int, int]) -> Result:
    """One run of ``variant``; ``distinct``: the ids a micro-batch and a step are expected to hold (the plan's)."""
    label, variant_overrides = VARIANTS[variant]
    out_dir = args.out / model.name / variant
    result = Result(model.name, variant, label, out_dir=str(out_dir))
    micro = args.micro_batch or model.micro_batch
    overrides = [*model.overrides, *variant_overrides, f"model.vocab_size={vocab}", f"data.dir={corpus}",
                 f"data.vocab_size={vocab}", f"train.steps={args.steps}", f"train.global_batch_size={args.global_batch}",
                 f"train.micro_batch_size={micro}", "train.eval_iters=0", "train.log_interval=1",
                 "checkpoint.resume=false", "checkpoint.save=false", f"logging.profile_step={args.steps}",
                 f"out_dir={out_dir}", *args.overrides]
    if variant == FIT:
        rows = rows_within(overrides, args.nproc, gpu is not None, distinct)
        if rows < distinct[1]:  # a set below a step's ids would grow in the run, past the plan
            result.status = "not run"
            result.note = (f"no working set of a step's {distinct[1]:,} rows fits within {WITHIN_DENSE:.2f}x dense's "
                           f"plan here ({rows:,} rows would)")
            return result
        overrides.insert(len(model.overrides) + len(variant_overrides), f"host_tables.resident_rows={rows}")
        result.label = f"STEM-1/3 working set {rows:,}"
    result.plan_device_bytes = planned_bytes(overrides, args.nproc, gpu is not None, distinct)
    if gpu and not args.run_all and result.plan_device_bytes and result.plan_device_bytes > gpu["total_memory"]:
        result.status = "out of memory"
        result.note = (f"not run: the plan's {result.plan_device_bytes / GIB:.1f} GiB per GPU exceed the GPU's "
                       f"{gpu['total_memory'] / GIB:.1f} GiB (--run-all runs it anyway)")
        return result
    seconds = args.timeout if args.until is None else min(args.timeout, args.until - time.time())
    if seconds < model.min_run_s:
        result.status, result.note = "not run", f"{max(seconds, 0):.0f} s left before --until"
        return result
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
           "-m", "stem_megatron.train", *overrides]
    (out_dir.parent / f"{variant}.cmd").write_text(" ".join(cmd) + "\n")
    rc, stderr = launch(cmd, out_dir.parent / f"{variant}.log", seconds)
    if rc != 0:
        result.status, result.note = failure(rc, stderr)
        if result.status == "out of memory" and result.plan_device_bytes:
            result.note += f" [plan: {result.plan_device_bytes / GIB:.2f} GiB per {'GPU' if gpu else 'rank'}]"
        return result
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["step"] > args.warmup and r["step"] != args.steps] or \
        [r for r in records if r["step"] != args.steps] or records
    result.steps_timed = [r["step"] for r in timed]
    result.step_time_s = median([r["step_time_s"] for r in timed])
    cfg = json.loads((out_dir / "config.json").read_text())
    result.tokens_per_s = cfg["train"]["global_batch_size"] * cfg["model"]["seq_length"] / result.step_time_s
    result.mfu = median([r.get("mfu") for r in timed])
    if cfg["stem"]["variant"] != "dense" and cfg["host_tables"]["placement"] == "host":
        result.optimizer = cfg["host_tables"]["optimizer"]
        result.stem = {key: median([r.get(key) for r in timed]) for key in STEM_PARTS}
    profile = out_dir / f"profile_step{args.steps}.json"
    if profile.exists():
        prof = json.loads(profile.read_text())
        gpu_run = prof["device"] == "gpu"
        result.peak_memory_bytes = prof["max_memory_allocated_bytes"] if gpu_run else prof["peak_rss_bytes"]
        result.peak_memory_kind = "max_memory_allocated" if gpu_run else "peak_rss"
        ops = prof["ops"]
        result.profile = {"step": prof["step"], "table": str(out_dir / f"profile_step{args.steps}.txt"),
                          "by_self_cpu": sorted(ops, key=lambda o: o["self_cpu_s"], reverse=True)[: args.top]}
        if gpu_run:
            result.profile["by_self_device"] = sorted(ops, key=lambda o: o["self_device_s"] or 0.0,
                                                      reverse=True)[: args.top]
    return result


# ---------------------------------------------------------------- output
def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _mb(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / MB:.2f}"


def _gib(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / GIB:.2f}"


COLUMNS = (("variant", 26, "<"), ("step ms", 9, ">"), ("tokens/s", 10, ">"), ("MFU", 6, ">"), ("peak GiB", 9, ">"),
           ("plan GiB", 9, ">"), ("x dense", 8, ">"), ("prefetch ms", 12, ">"), ("CPU Adam ms", 12, ">"),
           ("Adam wait ms", 13, ">"), ("exch. ms", 9, ">"), ("to dev MB", 10, ">"), ("from dev MB", 12, ">"),
           ("rows MB", 10, ">"))


def row(r: Result) -> str:
    if r.status != "ok":
        cells = [r.label, r.status.upper() if r.status == "out of memory" else r.status] + [""] * 3 + \
            [_gib(r.plan_device_bytes)]
        return "  ".join(f"{c:{a}{w}}" for c, (_, w, a) in zip(cells, COLUMNS)).rstrip() + f"\n    {r.note}"
    s = r.stem
    cells = [r.label, _ms(r.step_time_s), f"{r.tokens_per_s:,.0f}", "-" if r.mfu is None else f"{r.mfu:.1%}",
             _gib(r.peak_memory_bytes), _gib(r.plan_device_bytes),
             "-" if r.ratio_to_dense is None else f"{r.ratio_to_dense:.2f}",
             _ms(s.get("stem_prefetch_wait_s")), _ms(s.get("stem_cpu_adam_s")), _ms(s.get("stem_adam_wait_s")),
             _ms(s.get("stem_exchange_wait_s")), _mb(s.get("stem_bytes_to_device")), _mb(s.get("stem_bytes_from_device")),
             _mb(s.get("stem_device_row_bytes_peak"))]
    return "  ".join(f"{c:{a}{w}}" for c, (_, w, a) in zip(cells, COLUMNS))


def print_table(model: Model, results: list[Result], shapes_name: str, args, gpu: Optional[dict], vocab: int,
                seq: int, distinct: tuple[int, int]) -> None:
    micro = args.micro_batch or model.micro_batch
    print(f"\n{model.name} ({shapes_name} shapes): {args.global_batch} x {seq} = {args.global_batch * seq:,} tokens per "
          f"step, micro-batch {micro}, {args.nproc} process(es), V={vocab:,} (ids from the 128k profile); "
          f"{args.steps} steps, medians of steps {args.warmup + 1}-{args.steps - 1} (step {args.steps} profiled)")
    print("  ".join(f"{name:{a}{w}}" for name, w, a in COLUMNS))
    for r in results:
        print(row(r))
    kind = "torch.cuda.max_memory_allocated, rank 0" if gpu else "peak RSS of rank 0's process (CPU: no device)"
    print(f"peak: {kind}; plan: the memory plan's device bytes per {'GPU' if gpu else 'rank'} (flops/memory.py) at "
          f"the distinct ids expected, {distinct[0]:,} a micro-batch and {distinct[1]:,} a step; "
          f"x dense: step time / dense's in this invocation; STEM parts: medians per step, rank 0 (metrics.jsonl)")


def print_profiles(results: list[Result], top: int) -> None:
    for r in results:
        if not r.profile:
            continue
        print(f"\n{r.model} {r.label}: step {r.profile['step']} profiled on rank 0 ({r.profile['table']})")
        lists = [("self CUDA", "by_self_device", "self_device_s")] if "by_self_device" in r.profile else []
        for title, key, sort_key in lists + [("self CPU", "by_self_cpu", "self_cpu_s")]:
            print(f"  top {top} ops by {title} time:  {'calls':>7} {'self CPU ms':>12} {'self CUDA ms':>13}")
            for op in r.profile[key]:
                device = "-" if op["self_device_s"] is None else f"{op['self_device_s'] * 1e3:.2f}"
                print(f"    {op['name'][:56]:<56} {op['calls']:>7} {op['self_cpu_s'] * 1e3:>12.2f} {device:>13}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", choices=sorted(SHAPES), default=None,
                    help="tiny (model=tiny) | paper (1B-3L, 350M and 1B at 32,768 tokens a step); default: paper with "
                         "a GPU")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--models", default=None, help="paper shapes: of 1B-3L,350M,1B (default all)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (the last is profiled)")
    ap.add_argument("--warmup", type=int, default=None, help="first steps left out of the medians")
    ap.add_argument("--global-batch", type=int, default=None, help="sequences per step (default 16)")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (default by model)")
    ap.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per run: torchrun --nproc_per_node")
    ap.add_argument("--top", type=int, default=8, help="ops listed per profile")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is stopped")
    ap.add_argument("--until", type=float, default=None,
                    help="a deadline (seconds since the epoch): runs stop by then, and none starts with under a "
                         "minute left (a lease's end)")
    ap.add_argument("--run-all", action="store_true", help="also run variants whose plan exceeds the GPU's memory")
    ap.add_argument("--counts", type=Path, default=DEFAULT_COUNTS, help="per-id token counts (.npy)")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench_gpu_step", help="corpora and runs")
    ap.add_argument("--json", type=Path, help="write the records here")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run (e.g. host_tables.cache_rows=4096)")
    args = ap.parse_args(argv)
    take_charge()  # a run's orphans come here, and a SIGTERM ends the running one's processes before this exits
    gpu = gpu_info()
    shapes_name = args.shapes or ("paper" if gpu else "tiny")
    shapes = SHAPES[shapes_name]
    args.steps = args.steps or shapes.steps
    args.warmup = shapes.warmup if args.warmup is None else args.warmup
    args.global_batch = args.global_batch or shapes.global_batch
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    models = [m for m in shapes.models if args.models is None or m.name in args.models.split(",")]
    if unknown or not variants or not models or args.steps < 2 or not 0 <= args.warmup < args.steps:
        ap.error(f"--variants: choose from {', '.join(VARIANTS)}" if unknown or not variants else
                 "--models: none of them in these shapes" if not models else "need --steps >= 2, 0 <= --warmup < --steps")
    counts = load_counts(args.counts)
    print(f"gpu_step.py, {datetime.date.today()}: {machine(gpu)}")
    records = []
    for model in models:
        base = compose([*model.overrides, *args.overrides])
        vocab, seq = base.model.vocab_size, base.model.seq_length
        need = int(1.2 * args.steps * args.global_batch * (seq + 1)) + 8192
        corpus = write_corpus(args.out / f"corpus-v{vocab}", counts, vocab, need)
        micro = args.micro_batch or model.micro_batch
        par = base.parallel
        dp = max(1, args.nproc // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size))
        distinct = expected_distinct_ids(counts, vocab, (micro * seq, args.global_batch // dp * seq))
        extra = {"vocab": vocab, "seq_length": seq, "global_batch": args.global_batch, "micro_batch": micro,
                 "nproc": args.nproc, "distinct_ids": distinct}
        results = []
        for variant in variants:
            print(f"  {model.name} {variant} ...", flush=True)
            results.append(run_variant(model, variant, args, corpus, vocab, gpu, distinct))
            dense = next((r for r in results if r.variant == "dense" and r.status == "ok"), None)
            for r in results:
                if dense is not None and r.status == "ok":
                    r.ratio_to_dense = r.step_time_s / dense.step_time_s
            if args.json:  # after each run: a benchmark stopped later keeps what it measured
                args.json.write_text(json.dumps({
                    "date": str(datetime.date.today()), "machine": machine(gpu), "gpu": gpu, "shapes": shapes_name,
                    "steps": args.steps, "warmup": args.warmup,
                    "records": records + [r.__dict__ | extra for r in results]}, indent=2) + "\n")
        print_table(model, results, shapes_name, args, gpu, vocab, seq, distinct)
        print_profiles(results, args.top)
        records += [r.__dict__ | extra for r in results]


if __name__ == "__main__":
    main()
