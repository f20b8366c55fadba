"""Adam on table rows with DeepSpeed's CPU Adam kernel (AVX, multi-threaded C++).

``lazy`` (default) updates only the rows a step touched: their moments and weights, with weight
decay on those rows only and bias correction by the global step (the semantics of
``torch.optim.SparseAdam`` / TF LazyAdam). ``dense`` runs AdamW over every row of the table with zero
gradients for untouched rows: exactly the optimizer the paper describes (moments of untouched rows
decay, weight decay applies to all rows), at a cost that grows with V instead of touched rows.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch

_ids = itertools.count()  # one kernel state per RowAdam, in the op's own registry
_SOURCE = Path(__file__).parent / "csrc" / "row_adam.cpp"


def _kernel():
    """DeepSpeed's CPU Adam plus our row-indexed update, built by DeepSpeed's op builder (its flags and
    SIMD width detection) into TORCH_EXTENSIONS_DIR on first use."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder import CPUAdamBuilder

    class RowAdamBuilder(CPUAdamBuilder):
        NAME = "stem_row_adam"

        def absolute_name(self):
            return f"stem_megatron.host_tables.{self.NAME}_op"

        def sources(self):
            return [str(_SOURCE)]  # includes DeepSpeed's csrc/adam/cpu_adam_impl.cpp

        def include_paths(self):
            return ["csrc/includes", "csrc/adam"]

        def cxx_args(self):
            return cached_cxx_args(_extensions_root(), super().cxx_args)

    return RowAdamBuilder().load()


def _extensions_root() -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def _cpu_key() -> str | None:
    """What DeepSpeed's flags are chosen from: the architecture and the CPU's feature flags (x86 ``flags``, Arm
    ``Features`` in /proc/cpuinfo), with DeepSpeed's version; None where /proc/cpuinfo does not say."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    features = sorted({line for line in lines if line.partition(":")[0].strip() in ("flags", "Features")})
    if not features:
        return None
    import deepspeed

    return hashlib.sha256("\n".join([platform.machine(), deepspeed.__version__, *features]).encode()).hexdigest()[:16]


def cached_cxx_args(root: Path, detect: Callable[[], list[str]]) -> list[str]:
    """DeepSpeed's compiler flags for this kind of CPU (``detect``), detected once and kept in ``root``. Its
    detection (py-cpuinfo) times the clock in a child Python, twice: ~2.4 s of CPU in every process that loads
    the op, on every rank of every launch. The flags are the same list either way, so torch finds the op
    built and does not rebuild it; another kind of CPU (a cluster's other partition) gets an entry of its own."""
    key = _cpu_key()
    if key is None:
        return detect()
    path = root / "stem_row_adam_cxx_args.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = detect()
        root.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f"{path.name}.{os.getpid()}")  # ranks starting together each write whole files
        part.write_text(json.dumps(known, indent=1))
        part.replace(path)
    return list(known[key])


class RowAdam:
    """AdamW (decoupled weight decay) applied in place to contiguous fp32 row blocks."""

    def __init__(self, betas: tuple[float, float], eps: float, weight_decay: float):
        self.kernel = _kernel()
        self.opt_id = next(_ids)
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, weight_decay
        self._kernel_step = None
        self.kernel.create_adam(self.opt_id, 0.0, self.beta1, self.beta2, eps, weight_decay, True, False)

    def _start(self, step: int) -> None:
        """A fresh kernel state for each step. The kernel otherwise derives beta^step by multiplying
        onto its previous step's value, so the bias correction (in float) would depend on where the
        run started: a resumed run would drift from a straight one in the last bits."""
        if step != self._kernel_step:
            self.kernel.destroy_adam(self.opt_id)
            self.kernel.create_adam(self.opt_id, 0.0, self.beta1, self.beta2, self.eps, self.weight_decay,
                                    True, False)
            self._kernel_step = step

    def update(self, step: int, lr: float, param, grad, exp_avg, exp_avg_sq) -> None:
        """One AdamW step for ``param`` rows (all four tensors contiguous, same shape, fp32)."""
        if param.numel() == 0:
            return
        self._start(step)
        self.kernel.adam_update(self.opt_id, step, lr, self.beta1, self.beta2, self.eps, self.weight_decay,
                                True, param, grad, exp_avg, exp_avg_sq)

    def update_rows(self, step: int, lr: float, ids, grads, param, exp_avg, exp_avg_sq, grad_rows=None) -> None:
        """Lazy update: AdamW in place on rows ``ids`` (sorted, unique int64, as the store passes them)
        of the contiguous fp32 tables, ``grads[r]`` for row ``ids[r]`` (``grads[grad_rows[r]]`` with
        ``grad_rows``: the store's order of rows is not its gradients', which stay where they landed); no
        gather/scatter copies."""
        self._rows(step, lr, ids, grads.contiguous(), param, exp_avg, exp_avg_sq, grad_rows)

    def update_untouched_rows(self, step: int, lr: float, ids, param, exp_avg, exp_avg_sq) -> None:
        """Dense mode's rows without a gradient: ``update_rows`` with zero gradients, bit for bit, without a
        zero tensor of their size (V x columns per layer and step, GBs at 350M)."""
        self._rows(step, lr, ids, None, param, exp_avg, exp_avg_sq)

    def _rows(self, step: int, lr: float, ids, grads, param, exp_avg, exp_avg_sq, grad_rows=None) -> None:
        self._start(step)
        self.kernel.row_adam_update(self.opt_id, step, lr, self.beta1, self.beta2, self.eps, self.weight_decay,
                                    True, ids.contiguous(), grads, param, exp_avg, exp_avg_sq,
                                    None if grad_rows is None else grad_rows.contiguous())

    def __del__(self):
        kernel = getattr(self, "kernel", None)
        if kernel is not None:
            kernel.destroy_adam(self.opt_id)
