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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: the recipe's tp*pp)")
    parser.add_argument("--distinct-ids", type=int, default=None, help="as stem-flops --distinct-ids")
    parser.add_argument("--json", default=None, help="write plan, measurement and ratios here")
    parser.add_argument("overrides", nargs="*", help="stem-train overrides (recipes), e.g. model.vocab_size=65536")
    args = parser.parse_args()
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
    measured = measure(args.overrides, nproc, cfg.stem.shm_dir)
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
