"""``checkpoint.init_from_hf=DIR``: a new run's weights from a Hugging Face Llama or Qwen2 directory, at any
TP/PP/DP layout (docs/checkpoints.md, "Hugging Face import").

Every rank reads the tensors of its own stage from the safetensors shards (memory-mapped), fuses them into megatron's
layout (``export.hf.tensors.to_megatron``) and keeps its TP slice (``model.sharding.shard_of``), as the layout tests load one
process's weights. With a STEM variant the planned layers become STEM layers: ``W_g`` and ``W_d`` are the dense
gate and down projections, the up-projection is dropped (kept as ``W_u`` by STEM† and the gate ablation), and
``U_l`` is drawn by ``stem.table_init`` as for a new run, or with ``from_dense`` computed from the dense model
(``calibration``). The optimizer, schedule and step start fresh.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist

from stem_megatron.checkpoint.hf.calibration import mean_ffn_inputs
from stem_megatron.checkpoint.hf.model_config import read_hf_model
from stem_megatron.checkpoint.hf.shards import shard_files
from stem_megatron.config import ConfigError, RunConfig
from stem_megatron.export.hf.tensors import to_megatron
from stem_megatron.layer_plan import planned_layers
from stem_megatron.model.sharding import local_to_global, shard_of


class HFWeights:
    """A Hugging Face directory's tensors by name, read on demand from its safetensors shards."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.directory = directory
        files = shard_files(directory)
        self._stack = ExitStack()
        self._where = {}
        for file in files:
            handle = self._stack.enter_context(safe_open(str(directory / file), framework="pt"))
            self._where.update({name: handle for name in handle.keys()})

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ConfigError(f"checkpoint.init_from_hf: {self.directory} has no tensor {name}: its weights do "
                              f"not match its config.json (an incomplete or foreign save)")
        return self._where[name].get_tensor(name)

    def close(self) -> None:
        self._stack.close()


def _stem_tables(trainer) -> dict[int, torch.nn.Parameter]:
    """This stage's device-resident ``U_l`` parameters by 0-based global layer (host placement: none)."""
    stage = trainer.model.module
    names = local_to_global(stage)
    return {int(names[n].split(".")[2]): p for n, p in stage.named_parameters() if n.endswith("mlp.U_l.weight")}


@torch.no_grad()
def init_from_hf(cfg: RunConfig, trainer) -> Path:
    """Load ``checkpoint.init_from_hf`` into ``trainer``'s model (and its STEM tables with ``from_dense``);
    collective over the world. Returns the directory."""
    hf = read_hf_model(cfg.checkpoint.init_from_hf)
    m = cfg.model
    read = HFWeights(hf.directory)
    try:
        stage = trainer.model.module
        names = local_to_global(stage)
        for local, param in stage.named_parameters():
            full = to_megatron(names[local], read, m.num_attention_heads, m.num_query_groups or m.num_attention_heads,
                               m.vocab_size, hf.tied)
            if full is None:  # a STEM table: below
                continue
            part = shard_of(full, param)
            if part.shape != param.shape:
                raise ConfigError(f"checkpoint.init_from_hf: {hf.directory}'s {names[local]} has shape "
                                  f"{tuple(full.shape)}, which the model's {tuple(param.shape)} (this rank's part) "
                                  f"does not take: its tensors do not match its config.json")
            param.copy_(part)
        if cfg.stem.table_init == "from_dense":
            _tables_from_dense(cfg, trainer, hf.directory, read)
    finally:
        read.close()
    trainer.optimizer.reload_model_params()
    dist.barrier()
    return hf.directory


def _tables_from_dense(cfg: RunConfig, trainer, directory: Path, read: HFWeights) -> None:
    """``U_l[t] = W_u E[x_l | t]`` into every STEM table of this stage (``calibration``), a group of layers at a time:
    a group's means become its tables and leave the device before the next group's pass."""
    host, device_tables = trainer.tables, _stem_tables(trainer)  # one of them holds this stage's tables
    layers = sorted(device_tables) + [layer - 1 for layer in host.layers]
    # every rank takes part in every group's pass (its all-reduces) and load (a node collective), also a stage with
    # none of the group's layers
    planned = planned_layers(cfg.model.num_layers, cfg.stem)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    for means in mean_ffn_inputs(cfg, directory, planned, cfg.model.vocab_size, device):
        tables = {}
        for layer in [layer for layer in layers if layer in means]:
            up = read(f"model.layers.{layer}.mlp.up_proj.weight").to(device, torch.float32)
            tables[layer] = (means.pop(layer) @ up.t()).cpu()  # V x d_ff: on the device, GPU or not
        means.clear()
        host.load_tables({layer + 1: table for layer, table in tables.items() if layer not in device_tables})
        for layer in set(tables) & set(device_tables):
            device_tables[layer].copy_(shard_of(tables[layer], device_tables[layer]))
