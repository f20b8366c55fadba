"""What a run is, said once at its start (and kept as ``config.json``), and what a step line adds: the operator's
view (rank 0 prints).

The start block names the model and its parameters (dense, STEM tables), the replaced layers, where the tables
live, the layout over nodes and the memory plan (``flops/memory.py``, the bytes ``stem-flops --memory`` prints)
against this node's memory and shared-memory directory; torchtitan and Megatron-LM print the same at start. A step
line adds an ETA from this job's recent steps and the memory in use (the device's peak on GPU, the process' on
CPU); its MFU comes from the record (``flops/mfu.py``, GPU only).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import resource
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from stem_megatron.config import RunConfig
from stem_megatron.flops.arch import arch_from_model_config
from stem_megatron.flops.memory import GIB, Layout, neediest_node, plan
from stem_megatron.flops.params import analytic_parameters
from stem_megatron.flops.variants import variant_from_stem_config
from stem_megatron.host_tables.node import free_space
from stem_megatron.layer_plan import planned_layers
from stem_megatron.parallel import have_transformer_engine, on_gpu
from stem_megatron.run_plan import micro_batches_per_step, tables_on_host


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB"


def say_start(cfg: RunConfig) -> None:
    """Rank 0: the run directory and the start block, and the run's config as ``config.json`` there."""
    if dist.get_rank() != 0:
        return
    print(f"run directory: {cfg.out_dir}", flush=True)
    for line in start_block(cfg, dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", 1)), on_gpu()):
        print(line, flush=True)
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.out_dir) / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))


def start_block(cfg: RunConfig, world: int, ranks_per_node: int, gpu: bool) -> list[str]:
    """The lines said before step 1."""
    m, s, h, par, t = cfg.model, cfg.stem, cfg.host_tables, cfg.parallel, cfg.train
    counts = analytic_parameters(arch_from_model_config(dataclasses.asdict(m)),
                                 variant_from_stem_config(s, cfg.hash_moe), tied=False, qkv_bias=False)
    replaced = [i + 1 for i in planned_layers(m.num_layers, s)]
    tp, pp, ep = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.expert_model_parallel_size
    dp, nodes = world // (tp * pp), max(1, world // ranks_per_node)
    lines = [f"model: {m.num_layers} layers, d {m.hidden_size}, d_ff {m.ffn_hidden_size}, V {m.vocab_size}, "
             f"sequence {m.seq_length}; {_count(counts['total'] - counts['tables'])} dense parameters"
             + (f" + {_count(counts['tables'])} in STEM tables" if counts["tables"] else "")
             + (f" ({_count(counts['inactive_experts'])} in experts a token does not run)"
                if counts["inactive_experts"] else "")]
    if replaced:
        if s.variant == "hash_moe":
            what = f"{cfg.hash_moe.num_experts} hashed experts"
        elif tables_on_host(cfg):
            what = f"tables in host memory ({h.shm_dir}), {h.optimizer} AdamW on the CPU"
        else:
            what = "tables on the device, with the model's optimizer"
        lines.append(f"{s.variant} in layer(s) {', '.join(map(str, replaced))} of {m.num_layers}: {what}")
    micro = micro_batches_per_step(cfg, dp)
    lines.append(f"layout: {nodes} node(s) x {ranks_per_node} {'GPU' if gpu else 'CPU'} rank(s), TP={tp} PP={pp} "
                 f"DP={dp} EP={ep}; global batch {t.global_batch_size} = {t.micro_batch_size} x DP {dp} x "
                 f"{micro} micro-batch(es), {t.global_batch_size * m.seq_length:,} tokens a step{_overlap(cfg, dp)}")
    lines.append(_memory_line(cfg, Layout(nodes, ranks_per_node, tp, pp, "gpu" if gpu else "cpu",
                                          have_transformer_engine()), gpu))
    return lines


def _overlap(cfg: RunConfig, dp: int) -> str:
    p = cfg.parallel
    if dp == 1 or not p.overlap_grad_reduce:
        return ""
    return "; DP reductions during backward" + (", weight all-gathers during forward" if p.overlap_param_gather else "")


def _memory_line(cfg: RunConfig, layout: Layout, gpu: bool) -> str:
    try:
        result = plan(cfg, layout)
    except ValueError as e:  # a layout the plan does not model (e.g. stages spread unevenly over nodes)
        return f"memory plan: not computed ({e})"
    here = os.path.isdir(cfg.host_tables.shm_dir)
    free, available = free_space(cfg.host_tables.shm_dir, cfg.host_tables.host_memory_gib) if here else (0, 0)
    most, shared, fits = neediest_node(result, free, available)
    line = f"memory plan: {_size(most['total'])} a node, {_size(shared)} of it shared in {cfg.host_tables.shm_dir}"
    if here:
        line += (f"; this node: MemAvailable {_size(available)}, {_size(free)} free there: "
                 f"{'fits' if fits else 'does NOT fit'}")
    if gpu:
        device = max(stage["device_total"] for stage in result["stages"])
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        line += f"; {_size(device)} a GPU (this one: {_size(total)})"
    return line


class StepClock:
    """The ETA from the mean of this job's last ``window`` steps, and the memory in use."""

    def __init__(self, last_step: int, window: int = 20):
        self.last_step = last_step
        self.times: collections.deque = collections.deque(maxlen=window)
        self._mark = time.monotonic()

    def tick(self, step: int) -> dict:
        """Call once a step; returns the record's ``eta_s`` and ``memory_gib``."""
        now = time.monotonic()
        self.times.append(now - self._mark)
        self._mark = now
        eta = (self.last_step - step) * sum(self.times) / len(self.times)
        return {"eta_s": eta, "memory_gib": memory_in_use() / GIB}


def memory_in_use() -> int:
    """The device's peak allocation so far (GPU; no synchronisation), else this process' peak resident set."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def eta_text(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    minutes, s = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h" if days else f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{s:02d}s"
