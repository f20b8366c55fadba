"""A run out of device memory, said for people: what the memory plan expected per GPU and the settings that lower it.

``stem-train`` (``train.py``) prints ``out_of_memory_message`` as its one line when a rank's step raises
``torch.OutOfMemoryError`` (also when it surfaces wrapped, e.g. from the row prefetch thread), instead of Hydra's
traceback around it. The plan is ``flops/memory.py``'s (``stem-flops --memory``) for this run's config and layout:
``WORLD_SIZE`` ranks, ``LOCAL_WORLD_SIZE`` of them per node.
"""

from __future__ import annotations

import os
import re
from typing import Optional

import torch

from stem_megatron.config import RunConfig
from stem_megatron.flops.memory import GIB, Layout, plan
from stem_megatron.parallel import have_transformer_engine
from stem_megatron.run_plan import tables_on_device, tables_on_host


def out_of_memory_in(error: BaseException) -> Optional[torch.OutOfMemoryError]:
    """The ``torch.OutOfMemoryError`` that ``error`` is or was raised from, if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, torch.OutOfMemoryError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def run_layout(cfg: RunConfig, world: int, per_node: int, gpu: bool) -> Layout:
    """The layout a run of ``world`` ranks, ``per_node`` a node, takes (its attention by whether TE is here)."""
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    return Layout(max(1, world // per_node), per_node, tp, pp, "gpu" if gpu else "cpu",
                  transformer_engine=have_transformer_engine())  # its attention kernel decides the activations


def planned_device_bytes(cfg: RunConfig, rank: int, world: int, per_node: int, gpu: bool,
                         distinct_ids: Optional[int] = None, step_distinct_ids: Optional[int] = None) -> int:
    """The plan's device bytes of ``rank``'s pipeline stage (ranks in megatron's order: TP, then DP, then PP), at the
    given distinct ids of a micro-batch and a step (default: their bounds)."""
    pp = cfg.parallel.pipeline_model_parallel_size
    stages = plan(cfg, run_layout(cfg, world, per_node, gpu), distinct_ids, step_distinct_ids)["stages"]
    return stages[min(rank // (world // pp), pp - 1)]["device_total"]


def _device(gpu: bool) -> str:
    if not gpu:
        return "the CPU"
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return f"GPU {index} ({props.name}, {props.total_memory / GIB:.1f} GiB in all)"


def out_of_memory_message(cfg: RunConfig, error: torch.OutOfMemoryError) -> str:
    """One line: where it ran out, what the plan expected for this rank, the knobs that lower it."""
    gpu = torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    asked = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", str(error))
    where = _device(gpu) + (f" while allocating {asked.group(1)}" if asked else "")
    unit = "GPU" if gpu else "rank"
    try:
        planned = planned_device_bytes(cfg, int(os.environ.get("RANK", "0")), world, per_node, gpu)
        expected = f"the memory plan expects {planned / GIB:.2f} GiB per {unit} for this run"
    except Exception as e:  # noqa: BLE001 - the plan is advice; the knobs below still apply
        expected = f"the memory plan could not be computed ({e})"
    p, h = cfg.parallel, cfg.host_tables
    knobs = [f"a smaller train.micro_batch_size (now {cfg.train.micro_batch_size}; the global batch stays, in "
             f"more micro-batches)",
             f"tensor or pipeline parallelism (parallel.tensor_model_parallel_size, now "
             f"{p.tensor_model_parallel_size}; parallel.pipeline_model_parallel_size, now "
             f"{p.pipeline_model_parallel_size})"]
    if tables_on_device(cfg):
        knobs.append("the STEM tables in host memory (host_tables.placement=host)")
    elif tables_on_host(cfg) and h.cache_rows:
        knobs.append(f"fewer hot rows on the device (host_tables.cache_rows, now {h.cache_rows})")
    elif tables_on_host(cfg) and h.resident_rows:
        knobs.append(f"a smaller working set (host_tables.resident_rows, now {h.resident_rows}; at least a step's "
                     f"distinct ids)")
    return (f"out of {'device ' if gpu else ''}memory on {where}: {expected} (`stem-flops --memory` with the same "
            f"overrides, docs/memory.md); lower it with " + ", ".join(knobs[:-1]) + " or " + knobs[-1])
