"""The lean row update in torch: the device working set's (``fused``) definition, op for op csrc/lean_adam.cpp's.

AdamW (decoupled weight decay, bias correction by the global step) on rows whose state may be lean
(docs/lean_tables.md): moments stored in bf16, the second moment one fp32 a row (the mean of g² over the row, or
over each of a row's column blocks), the master stored in bf16. Arithmetic is fp32, one rounding per op, in the C++
kernel's order; every bf16 store rounds stochastically with 16 bits of a counter-based hash of (seed, step, layer,
token id, global column), integer arithmetic in both, so on CPU both give the same bits and every tier, slot order
and TP layout draws the same bits for a row.
"""

from __future__ import annotations

import math
import struct

import torch

MASK = 0xFFFFFFFF


def _fp32(x: float) -> float:
    """``x`` rounded to fp32 (to nearest even), as C++ receives it."""
    return struct.unpack("f", struct.pack("f", x))[0]


def scalars(step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> list[float]:
    """The step's fp32 constants, in the kernel's order: beta1, 1 - beta1, beta2, 1 - beta2, eps,
    -lr / (1 - beta1^step), 1 / sqrt(1 - beta2^step), 1 - lr * weight_decay (computed in double, rounded once)."""
    beta1, beta2 = betas
    return [_fp32(x) for x in (beta1, 1 - beta1, beta2, 1 - beta2, eps, -lr / (1 - beta1**step),
                               1 / math.sqrt(1 - beta2**step), 1 - lr * weight_decay)]


def _mul32(x, c: int):
    """The low 32 bits of ``x * c`` for ``x`` in [0, 2^32) (int64 tensors or ints): in 16-bit halves of ``c``, so no
    int64 product overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK


def mix32(x):
    """Chris Wellons' lowbias32 on values in [0, 2^32) (int64 tensors or ints): the C++ kernel's ``mix32``."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def rounding_bits(seed: int, step: int, layer: int, tokens: torch.Tensor, col0: int, cols: int) -> torch.Tensor:
    """The hash's 32 bits (int64) for rows ``tokens`` and columns ``col0`` to ``col0 + cols`` (global columns)."""
    key = mix32(mix32(mix32(seed & MASK) ^ (step & MASK)) ^ (layer & MASK))
    keys = mix32((tokens.to(torch.int64) & MASK) ^ key)
    columns = torch.arange(col0, col0 + cols, dtype=torch.int64, device=tokens.device)
    return mix32((keys[:, None] + columns) & MASK)


def round_bf16(x: torch.Tensor, bits16: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` to bf16, rounded stochastically: ``bits16`` (in [0, 2^16)) added below the kept bits, truncated."""
    kept = (((x.view(torch.int32).to(torch.int64) & MASK) + bits16) & MASK) >> 16
    return ((kept ^ 0x8000) - 0x8000).to(torch.int16).view(torch.bfloat16)


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """fp32 square root, correctly rounded as C++'s ``std::sqrt``: torch's own fp32 sqrt on CPU is not (one in six
    results a bit off here); the fp64 root rounded to fp32 is (fp64 carries over twice fp32's digits)."""
    return x.double().sqrt().float()


def fold_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension in the kernel's fixed order: the upper half added onto the lower until one is
    left (an odd middle element waits a level)."""
    n = x.shape[-1]
    while n > 1:
        half = (n + 1) // 2
        x = torch.cat([x[..., :n - half] + x[..., half:n], x[..., n - half:half]], -1)
        n = half
    return x[..., 0]


def update(constants: list[float], seed: int, step: int, layer: int, col0: int, tokens: torch.Tensor,
           grads: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``master``, ``exp_avg``, ``exp_avg_sq`` (row r is token ``tokens[r]``) after a step with fp32 ``grads``:
    new tensors in the given dtypes. ``exp_avg_sq`` with fewer columns than ``master`` is row-wise: fp32, one value
    per block of ``cols / blocks`` columns."""
    beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2, decay = constants
    rows, cols = master.shape
    g = grads.float()
    m = exp_avg.float() * beta1 + g * one_minus_beta1
    if exp_avg_sq.shape[1] != cols:
        blocks = exp_avg_sq.shape[1]
        width = cols // blocks
        mean = fold_sum((g * g).view(rows, blocks, width)) / width
        v = exp_avg_sq * beta2 + mean * one_minus_beta2
        denom = (sqrt(v) * bias_correction2 + eps).repeat_interleave(width, dim=1)
    else:
        v = exp_avg_sq.float() * beta2 + (g * g) * one_minus_beta2
        denom = sqrt(v) * bias_correction2 + eps
    p = master.float() * decay + (m / denom) * step_size
    lean = [t.dtype == torch.bfloat16 for t in (master, exp_avg, exp_avg_sq)]
    if any(lean):
        bits = rounding_bits(seed, step, layer, tokens, col0, cols)
        p = round_bf16(p, bits >> 16) if lean[0] else p
        m = round_bf16(m, bits & 0xFFFF) if lean[1] else m
        v = round_bf16(v, mix32(bits) >> 16) if lean[2] else v
    return p, m, v
