"""A run's memory plan (``stem-flops --memory``) against what the run uses on this machine.

Runs ``python -m torch.distributed.run --nproc_per_node N -m stem_megatron.train <overrides>`` (its own out_dir,
no resume, no validation) on one node, polls every 50 ms and stops the run once step 2 is in ``metrics.jsonl``.
The run is given a third step, so that it is inside step 3 then, never writing its final checkpoint (which
stages copies of the model and tables: a poll after the log line could otherwise catch its start). Measured:
- shared memory: the run's tmpfs files, read from the ranks' ``/proc/<pid>/maps`` (the files are unlinked once
  mapped; each counted once, by inode; fallocated, so their size is their memory); and, for reference, the peak
  of the directory's used bytes (``statvfs``) minus the value before launch, which other users of the
  directory disturb;
- each rank's peak RSS (``VmHWM``, kept by the kernel: no peak is missed between polls). A rank's RSS counts
  every page of the node-shared tables it touched and the libraries' file pages, which the other ranks map
  too; a rank's own peak is ``VmHWM - RssShmem - RssFile``;
- the node: the ranks' own peaks summed, the libraries' pages once (the largest ``RssFile``) and the shared
  memory (tmpfs pages are allocated when created, touched or not);
- for reference, the peak of the ranks' summed Pss (``smaps_rollup``, polled: it splits shared pages over the
  processes mapping them, counts only touched /dev/shm pages, and can miss a short peak).

The plan predicts the shared memory, the ranks' own memory (processes, their parts) and the node total;
a rank's peak RSS is shown against its own parts plus every shared file of its node, an upper bound.

    .venv/bin/python benchmarks/memory_plan.py [--nproc N] [--json out.json] [OVERRIDE ...]

N defaults to the recipe's tp*pp (DP=1). On a machine without a GPU the plan is the CPU one (fp32); on a GPU without
Transformer Engine, the plan of SDPAttention's kernels.

    .venv/bin/python benchmarks/memory_plan.py --activations [OVERRIDE ...]

instead checks the plan's activations (``flops/activations.py``) against one micro-batch's real forward and backward
in this process (TP = PP = 1, after a warm-up micro-batch of one sequence; host STEM rows from a stand-in that hands
the layer an fp32 leaf of its micro-batch's rows, as the store does): the tensors autograd keeps (a saved-tensor hook,
each storage once, parameters and the rows' leaf aside), the peak of torch's allocations above those before the
micro-batch (CPU: the profiler's memory events; GPU: ``torch.cuda.max_memory_allocated``, and the allocator's
reserve), and on CPU the rise of the process's RSS high-water mark (a fresh process: its heap is new).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's stem_megatron, installed or not
from stem_megatron.setup_check import require_environment  # noqa: E402

require_environment()  # before torch and megatron: another Python gets `make setup`, not a traceback

import torch  # noqa: E402

from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402

from stem_megatron.flops.activations import activation_bytes, kept_bytes, transient_bytes  # noqa: E402
from stem_megatron.flops.memory import GIB, LIBRARY_BYTES, Layout, plan, print_plan  # noqa: E402
from stem_megatron.parallel import have_transformer_engine  # noqa: E402
from stem_megatron.recipes import compose_run  # noqa: E402

POLL_S = 0.05
STEPS = 2


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (torchrun's agent -> its ranks)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _kib(path: str, *keys: str) -> dict[str, int]:
    fields = {}
    for line in Path(path).read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in keys:
            fields[key] = int(rest.split()[0]) * 1024
    return fields


def _mapped_files(pid: int, directory: str) -> dict[int, int]:
    """inode -> bytes of the files under ``directory`` a process maps."""
    out = {}
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(directory.rstrip("/") + "/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out[int(fields[4])] = max(out.get(int(fields[4]), 0), end - start)
    return out


def _shm_used(directory: str) -> int:
    s = os.statvfs(directory)
    return (s.f_blocks - s.f_bfree) * s.f_frsize


def measure(overrides: list[str], nproc: int, shm_dir: str) -> dict:
    """Peaks of a 2-step run: shared memory, each rank's RSS and own memory, the node, the ranks' summed Pss."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "-m",
               "stem_megatron.train", *overrides, f"out_dir={out}", f"train.steps={STEPS + 1}", "train.eval_iters=0",
               "train.log_interval=1", "checkpoint.resume=false"]
        shm_before = _shm_used(shm_dir)
        agent = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)
        statvfs = pss = 0
        files: dict[int, int] = {}
        ranks: dict[int, dict[str, int]] = {}
        metrics = Path(out) / "metrics.jsonl"
        try:
            while agent.poll() is None:
                total = 0
                for pid in _children(agent.pid):
                    try:
                        total += _kib(f"/proc/{pid}/smaps_rollup", "Pss")["Pss"]
                        ranks[pid] = _kib(f"/proc/{pid}/status", "VmHWM", "RssFile", "RssShmem")
                        files.update(_mapped_files(pid, shm_dir))
                    except (OSError, KeyError):  # the rank ended between listing and reading
                        continue
                pss, statvfs = max(pss, total), max(statvfs, _shm_used(shm_dir) - shm_before)
                if metrics.exists() and any(json.loads(line)["step"] == STEPS
                                            for line in metrics.read_text().splitlines() if line.strip()):
                    break
                time.sleep(POLL_S)
            else:
                raise RuntimeError(f"the run ended before step {STEPS}:\n{agent.stdout.read()[-3000:]}")
        finally:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGTERM)  # the run's own session: torchrun and its ranks
            agent.wait()
    own = sum(r["VmHWM"] - r["RssShmem"] - r["RssFile"] for r in ranks.values())
    own += max(r["RssFile"] for r in ranks.values())
    shm = sum(files.values())
    return {"shm": shm, "shm_statvfs": statvfs, "ranks_own": own, "node": own + shm, "pss_sum": pss,
            "rss_max": max(r["VmHWM"] for r in ranks.values()), "ranks": len(ranks)}


class StandInRows(MegatronModule):
    """A host STEM layer's row source without a store: each micro-batch's distinct ids' rows as a new fp32 leaf
    (``[u, d_ff]``, random) with each token's position among them, as ``HostRowSource`` hands them over."""

    leaves: list = []  # the rows handed out: the plan counts them as the step's rows, not as activations

    def __init__(self, config, vocab_size: int):
        super().__init__(config=config)
        del vocab_size  # the rows are drawn, not looked up
        self.cols = config.ffn_hidden_size

    def set_layer_number(self, layer_number: int) -> None:
        del layer_number

    def compact(self, tokens):
        uniq, inverse = torch.unique(tokens.ids, return_inverse=True)
        rows = torch.randn(len(uniq), self.cols, device=tokens.ids.device).requires_grad_()
        self.leaves.append(rows)
        return rows, inverse.t(), None

    def forward(self, tokens):
        rows, index, _ = self.compact(tokens)
        return torch.nn.functional.embedding(index, rows).to(self.config.params_dtype)


def measure_activations(cfg) -> dict:
    """One micro-batch's forward and backward of ``cfg``'s model on this process's device (megatron initialised,
    TP = PP = 1): bytes kept for backward, the peak of torch's allocations above those before it, on GPU the
    allocator's reserve and on CPU the RSS high-water mark's rise; the micro-batch's distinct ids and the bytes of
    its rows' leaves (in those peaks, in the plan's step rows)."""
    from torch.profiler import ProfilerActivity, profile

    from stem_megatron.model.gpt import build_gpt, transformer_config
    from stem_megatron.model.token_context import token_ids

    gpu, m, s = torch.cuda.is_available(), cfg.model, cfg.stem
    mask = cfg.data.reset_attention_mask
    host = cfg.host_tables.placement == "host" and s.variant not in ("dense", "hash_moe")
    config = transformer_config(m, cfg.parallel, on_gpu=gpu, stem=s, hash_moe=cfg.hash_moe)
    model = build_gpt(m, s, config, row_source=ModuleSpec(module=StandInRows) if host else None,
                      use_te=gpu and have_transformer_engine(),
                      attn_mask_type=AttnMaskType.arbitrary if mask else AttnMaskType.causal, hash_moe=cfg.hash_moe)
    for p in model.parameters():  # the gradient buffer exists before: backward's new gradients are added into it
        p.grad = torch.zeros_like(p)
    device = torch.device("cuda" if gpu else "cpu")
    out: dict = {}

    def micro_batch(batch: int) -> None:
        StandInRows.leaves.clear()
        kept: dict[int, int] = {}
        aside = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in aside | {r.untyped_storage().data_ptr() for r in
                                                             StandInRows.leaves}:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        tokens = torch.randint(0, m.vocab_size, (batch, m.seq_length), device=device)
        position = torch.arange(m.seq_length, device=device).expand_as(tokens)
        causal = torch.ones(m.seq_length, m.seq_length, dtype=torch.bool, device=device).triu(1)
        attention_mask = causal.repeat(batch, 1, 1, 1) if mask else None  # as the batches carry it
        if mask:  # the batch holds it until its backward
            kept[attention_mask.untyped_storage().data_ptr()] = attention_mask.untyped_storage().nbytes()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), token_ids(tokens, m.vocab_size):
            loss = model(tokens, position, attention_mask, labels=tokens)
        out.update(kept=sum(kept.values()), distinct_ids=len(torch.unique(tokens)),
                   rows=sum(r.untyped_storage().nbytes() for r in StandInRows.leaves))
        loss.float().sum().backward()

    status = f"/proc/{os.getpid()}/status"
    if not gpu:
        Path("/proc/self/clear_refs").write_text("5")  # the RSS high-water mark starts again here
        rss = _kib(status, "VmRSS")["VmRSS"]
    micro_batch(1)  # warm-up: lazy initialisation, the allocator's first blocks
    batch = cfg.train.micro_batch_size
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        micro_batch(batch)
        torch.cuda.synchronize()
        out.update(peak=torch.cuda.max_memory_allocated() - allocated,
                   reserved=torch.cuda.max_memory_reserved() - reserved)
        return out
    micro_batch(batch)  # the first at full size: the heap grows as a run's first micro-batches grow it
    out["rss"] = _kib(status, "VmHWM")["VmHWM"] - rss
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        micro_batch(batch)  # the same allocations again, each one recorded
    live = out["peak"] = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        live += nbytes
        out["peak"] = max(out["peak"], live)
    return out


def activations(overrides: list[str]) -> None:
    """``--activations``: the plan's activations of ``overrides`` at TP = PP = 1 against a measured micro-batch."""
    from stem_megatron import parallel

    cfg = compose_run(overrides)
    cfg.parallel.tensor_model_parallel_size = cfg.parallel.pipeline_model_parallel_size = 1
    gpu = torch.cuda.is_available()
    parallel.single_process_env()
    parallel.initialize(1, 1, cfg.train.seed)
    try:
        measured = measure_activations(cfg)
    finally:
        parallel.destroy()
    layout = Layout(1, 1, device="gpu" if gpu else "cpu", transformer_engine=have_transformer_engine())
    kept = kept_bytes(cfg, layout, 0, measured["distinct_ids"])
    leaves = measured["rows"]  # the plan's step rows, not activations
    rows = [("kept for backward", kept, measured["kept"]),
            ("peak of the allocations", kept + transient_bytes(cfg, layout, 0), measured["peak"] - leaves),
            ("RSS high-water rise" if not gpu else "allocator's reserve (peak)",
             activation_bytes(cfg, layout, 0, 1, measured["distinct_ids"]),
             measured["rss" if not gpu else "reserved"] - leaves)]
    print(f"activations of one micro-batch ({cfg.train.micro_batch_size} x {cfg.model.seq_length} tokens, "
          f"{measured['distinct_ids']:,} distinct ids), {'GPU' if gpu else 'CPU'}, TP = PP = 1: "
          + " ".join(overrides))
    print(f"  {'':<30}{'plan':>12}{'measured':>12}{'ratio':>8}")
    for label, p, m in rows:
        print(f"  {label:<30}{p / 2**20:>8.1f} MiB{m / 2**20:>8.1f} MiB{m / p:>8.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: the recipe's tp*pp)")
    parser.add_argument("--distinct-ids", type=int, default=None, help="as stem-flops --distinct-ids")
    parser.add_argument("--json", default=None, help="write plan, measurement and ratios here")
    parser.add_argument("--activations", action="store_true",
                        help="check the plan's activations against one micro-batch in this process instead")
    parser.add_argument("overrides", nargs="*", help="stem-train overrides (recipes), e.g. model.vocab_size=65536")
    args = parser.parse_args()
    if args.activations:
        return activations(args.overrides)
    cfg = compose_run(args.overrides)
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    nproc = args.nproc or tp * pp
    layout = Layout(1, nproc, tp, pp, "gpu" if torch.cuda.is_available() else "cpu", have_transformer_engine())
    planned = plan(cfg, layout, args.distinct_ids)
    print_plan(planned, " ".join(args.overrides) or "the demo (recipes/train.yaml)")
    node = planned["nodes"][0]
    shared = sum(node["shared"].values())
    rank = max(s["device_total"] for s in planned["stages"]) * (layout.device == "cpu")
    rank += (node["ranks"]["process"] - LIBRARY_BYTES + node["ranks"]["adam_gradients"]
             + node["ranks"]["pinned_rows"]) // nproc + LIBRARY_BYTES
    measured = measure(args.overrides, nproc, cfg.host_tables.shm_dir)
    rows = [("shared memory (the run's files)", shared, measured["shm"]),
            ("ranks' own memory (+ libraries once)", sum(node["ranks"].values()), measured["ranks_own"]),
            ("node total", node["total"], measured["node"]),
            ("largest rank RSS (plan: upper bound)", rank + shared, measured["rss_max"])]
    print(f"\n{'measured on this machine, ' + str(nproc) + ' rank(s)':<42}{'plan':>12}{'measured':>12}{'ratio':>8}")
    for label, p, m in rows:
        print(f"  {label:<40}{p / GIB:>8.3f} GiB{m / GIB:>8.3f} GiB{m / p if p else float('nan'):>8.3f}")
    for label, key in (("(shm directory's use, statvfs)", "shm_statvfs"),
                       ("(summed Pss of the ranks, polled)", "pss_sum")):
        print(f"  {label:<40}{'':>12}{measured[key] / GIB:>8.3f} GiB")
    if args.json:
        Path(args.json).write_text(json.dumps({"plan": planned, "measured": measured, "rows": [
            {"what": label, "plan": p, "measured": m, "ratio": m / p if p else None} for label, p, m in rows]},
            indent=2))


if __name__ == "__main__":
    main()
