"""Model-FLOPs throughput and MFU of a training step.

``model_flops_per_token`` / ``throughput_metrics`` give the achieved model TFLOP/s of a step and,
when the accelerator's peak is known (a GPU from ``PEAK_BF16_TFLOPS`` or an explicit value), the
model FLOPs utilisation (MFU); on CPU the MFU is ``None``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Optional

from stem_megatron.flops.arch import arch_from_model_config
from stem_megatron.flops.counts import training_flops
from stem_megatron.flops.variants import DENSE, variant_from_stem_config

# Dense (no 2:4 sparsity) BF16 tensor-core peak per GPU, TFLOP/s, from the vendor data sheets.
# Matched in order against torch.cuda.get_device_name(); the first pattern found wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"GB200|B200", 2250.0),
    (r"H200", 989.0),
    (r"H100.*PCIe", 756.0),
    (r"H100.*NVL", 835.0),
    (r"H100|GH200", 989.0),
    (r"A100", 312.0),
    (r"L40S", 362.0),
    (r"\bL4\b", 121.0),
    (r"\bA10\b", 125.0),
)


def model_flops_per_token(model: Any, stem: Any = None, hash_moe: Any = None) -> int:
    """Training (forward + backward = 3x forward) matmul FLOPs per token of the whole model, from
    ``stem_megatron.flops.counts``' exact count (GQA-aware, attention over the full sequence, LM head;
    equal to ``torch.utils.flop_counter`` on the megatron-core model). ``model``/``stem``/``hash_moe`` are
    ``ModelConfig``/``STEMConfig``/``HashMoEConfig`` or their dicts from config.json."""
    arch = arch_from_model_config(_as_dict(model))
    variant = DENSE if stem is None else variant_from_stem_config(stem, hash_moe)
    seq = arch.seq_length
    return training_flops(arch, seq, variant)["total"] // seq


def _as_dict(obj: Any) -> dict:
    return dict(obj) if isinstance(obj, Mapping) else dataclasses.asdict(obj)


def device_peak_tflops(device_name: Optional[str] = None) -> Optional[float]:
    """Dense BF16 peak TFLOP/s of one GPU, by name (default: the current CUDA device); ``None`` on
    CPU or for a GPU not in ``PEAK_BF16_TFLOPS`` (pass ``logging.peak_tflops`` explicitly then)."""
    if device_name is None:
        try:
            import torch

            if not torch.cuda.is_available():
                return None
            device_name = torch.cuda.get_device_name()
        except Exception:  # noqa: BLE001 - no usable CUDA means no known peak
            return None
    for pattern, peak in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return peak
    return None


def throughput_metrics(tokens_per_s: float, flops_per_token: float, peak_tflops: Optional[float] = None,
                       num_devices: int = 1) -> dict:
    """Achieved model TFLOP/s of the job and per device, and MFU (``None`` without a known peak).

    ``tokens_per_s`` is the job's global throughput (the loop's ``tokens_per_s``: global batch tokens
    over the step time); ``peak_tflops`` is one device's peak; ``num_devices`` the world size.
    """
    tflops = tokens_per_s * flops_per_token / 1e12
    per_device = tflops / num_devices
    mfu = per_device / peak_tflops if peak_tflops else None
    return {"tflops_per_s": tflops, "tflops_per_s_per_device": per_device, "mfu": mfu}
