"""Where a planned run's ranks sit (``Layout``) and which layers a pipeline stage holds: what the memory plan
(``memory.py``) and its activation count (``activations.py``) both read."""

from __future__ import annotations

from dataclasses import dataclass

from stem_megatron.config import RunConfig


@dataclass(frozen=True)
class Layout:
    """Where the ranks run: ``nodes`` x ``gpus_per_node`` ranks in megatron's order (TP fastest, then DP, PP)."""

    nodes: int = 1
    gpus_per_node: int = 8
    tp: int = 1
    pp: int = 1
    device: str = "gpu"  # gpu: bf16 weights | cpu: fp32, SDPAttention (torch's SDPA)
    transformer_engine: bool = True  # on GPU: TE's attention; False: SDPAttention, as on CPU (no TE installed)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)


def stage_layers(cfg: RunConfig, pp: int, stage: int) -> range:
    """0-based layers of pipeline ``stage`` of ``pp`` (megatron splits them evenly)."""
    per = cfg.model.num_layers // pp
    return range(stage * per, (stage + 1) * per)
