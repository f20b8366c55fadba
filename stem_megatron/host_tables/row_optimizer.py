"""AdamW on STEM table rows: the one row optimizer every tier uses (docs/host_tables.md).

Semantics. ``lazy`` (default) updates only the rows a step touched: their moments and weights, with weight decay on
those rows only and bias correction by the global step (``torch.optim.SparseAdam`` / TF LazyAdam). ``dense`` runs
AdamW over every row with zero gradients for untouched rows: exactly the optimizer the paper describes (moments of
untouched rows decay, weight decay applies to all rows), at a cost that grows with V instead of touched rows.

Back ends, chosen once by where the rows are: ``rows``, DeepSpeed's CPU Adam kernel (AVX, multi-threaded C++) with
our row-indexed entry point (``csrc/row_adam.cpp``), in place on host rows, and on a working set's slots on CPU
(bitwise the host's values); ``fused``, torch's fused AdamW on a GPU's slots (the rows gathered, updated and put
back: other arithmetic, equal within fp32 rounding, tests/test_working_set.py states the bound).

Lean state (``row_state.StateSpec``: bf16 moments, a row-wise second moment, a bf16 master; docs/lean_tables.md)
takes one definition on both back ends: ``csrc/lean_adam.cpp`` for ``rows``, ``lean_adam.update`` (torch, the same
ops in the same order: bitwise the C++ on CPU) for ``fused``.

The decay of the rows a dense step did not touch beside the next step is the Adam thread's schedule
(``adam_thread.LaterDecay``, ``adam_thread.MissedUpdate``).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from stem_megatron.host_tables import lean_adam
from stem_megatron.host_tables.row_state import RowState, StateSpec
from stem_megatron.host_tables.transfer import copy_to_device

_ids = itertools.count()  # one kernel state per RowAdam, in the op's own registry
_SOURCE = Path(__file__).parent / "csrc" / "row_adam.cpp"


def op_name(name: str, source: Path) -> str:
    """``name`` with a digest of ``source``'s directory: the op's build directory under ``extensions_root()``. ninja
    rebuilds when the compile command changes, and the command names the source's path: a copy of the tree run with
    the same venv (an old commit's, to compare) would otherwise take over the one build directory, and the checkout
    and the copy would rebuild in turn (~27 s each)."""
    return f"{name}_{hashlib.sha256(str(source.resolve().parent).encode()).hexdigest()[:8]}"


def _kernel(name: str = "stem_row_adam", source: Path = _SOURCE, flags: tuple[str, ...] = ()):
    """DeepSpeed's CPU Adam plus our row-indexed update (or ``source``, built as op ``name`` with DeepSpeed's flags
    and ``flags``), built by DeepSpeed's op builder (its flags and SIMD width detection) into ``extensions_root()``
    on first use, one build per checkout (``op_name``)."""
    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions_root())  # torch's loader, and every process started after
    # torch runs `ninja` from PATH; pip installs it beside the venv's Python, off PATH when a script runs without the
    # venv activated (.venv/bin/python tools/gpu_check.py)
    here = str(Path(sys.executable).parent)
    if here not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([here, *filter(None, [os.environ.get("PATH")])])
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder import CPUAdamBuilder

    class RowAdamBuilder(CPUAdamBuilder):
        NAME = op_name(name, source)

        def absolute_name(self):
            return f"stem_megatron.host_tables.{self.NAME}_op"

        def sources(self):
            return [str(source)]  # row_adam.cpp includes DeepSpeed's csrc/adam/cpu_adam_impl.cpp

        def include_paths(self):
            return ["csrc/includes", "csrc/adam"]

        def cxx_args(self):
            return cached_cxx_args(extensions_root(), super().cxx_args) + list(flags)

    return RowAdamBuilder().load()


@functools.cache
def lean_kernel():
    """``csrc/lean_adam.cpp``, the lean row update's definition on CPU: each fp32 op rounded once (no contraction
    into FMAs), as the torch version in ``lean_adam.py`` computes it."""
    return _kernel("stem_lean_adam", _SOURCE.with_name("lean_adam.cpp"), ("-ffp-contract=off", "-fno-math-errno"))


def extensions_root() -> Path:
    """Where the op is built and found: ``TORCH_EXTENSIONS_DIR`` when set, else the venv's own ``torch_extensions``
    (one build per venv and checkout, which `make setup` made). torch's default, ``~/.cache/torch_extensions``, is
    shared by every venv of the user, so a script run directly from another venv (or a node whose home is elsewhere)
    would rebuild the op there: about a minute of a GPU node's 16 cores."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path(sys.prefix) / "torch_extensions")


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

    def lean_rows(self, step: int, lr: float, layer: int, ids, tokens, grads, param, exp_avg, exp_avg_sq,
                  grad_rows=None, seed: int = 0, col0: int = 0) -> None:
        """Lean AdamW (``csrc/lean_adam.cpp``) in place on rows ``ids`` (sorted, unique) of ``layer``'s tensors in
        any ``StateSpec``'s dtypes, ``grads`` as ``update_rows``' (None: zero gradients, dense Adam's untouched
        rows); ``tokens``, each row's token id, and ``col0``, the block's first global column, draw the rounding."""
        if ids.numel():
            lean_kernel().lean_adam_rows(
                lean_adam.scalars(step, lr, (self.beta1, self.beta2), self.eps, self.weight_decay), seed, step, layer,
                col0, ids.contiguous(), tokens.contiguous(), None if grads is None else grads.contiguous(),
                None if grad_rows is None else grad_rows.contiguous(), param, exp_avg, exp_avg_sq)

    def __del__(self):
        kernel = getattr(self, "kernel", None)
        if kernel is not None:
            kernel.destroy_adam(self.opt_id)


EMPTY = torch.empty(0, dtype=torch.int64)


class RowOptimizer:
    """AdamW (``RowAdam``'s hyperparameters) on rows of a ``RowState`` by the ``kernel`` back end (``rows``:
    DeepSpeed's, ``fused``: torch's, on ``device``); ``dense``: the recipe's dense Adam, where the caller passes the
    rows without a gradient as ``untouched``. A lean ``spec`` runs the lean update (``lean_adam``: its C++ kernel for
    ``rows``, its torch definition for ``fused``), whose rounding draws from ``seed``, the row's token id
    (``token_ids(rows)``: the state's row indices to token ids; without it they are the ids) and ``col0``, the first
    global column of the state's block (a TP rank's)."""

    LEAN_CHUNK = 4096  # rows a fused lean update computes at once: its temporaries (the hash's int64) stay bounded

    def __init__(self, adam: RowAdam, kernel: str, device: torch.device, dense: bool = False,
                 spec: StateSpec = StateSpec(), seed: int = 0, col0: int = 0,
                 token_ids: Callable[[torch.Tensor], torch.Tensor] | None = None):
        if kernel not in ("rows", "fused"):
            raise ValueError(f"row optimizer kernel must be 'rows' or 'fused', got {kernel!r}")
        self.adam, self.kernel, self.device, self.dense = adam, kernel, device, dense
        self.spec, self.seed, self.col0 = spec, seed, col0
        self.token_ids = token_ids or (lambda rows: rows)

    def update(self, step: int, lr: float, state: RowState, layer: int, rows: torch.Tensor, grads: torch.Tensor,
               grad_rows: torch.Tensor | None = None, untouched: torch.Tensor = EMPTY) -> None:
        """Step ``step`` at ``lr`` on ``layer``'s ``rows`` of ``state`` (sorted, distinct; host indices) with gradient
        ``grads[grad_rows[i]]`` for ``rows[i]`` (``grads[i]`` without ``grad_rows``: the gradients stay where they
        landed), then on ``untouched`` (sorted) with a zero gradient, without a tensor of those zeros."""
        if self.kernel == "rows":
            if self.spec.lean:
                self.adam.lean_rows(step, lr, layer, rows, self.token_ids(rows), grads, *state.of(layer), grad_rows,
                                    self.seed, self.col0)
            elif rows.numel():
                self.adam.update_rows(step, lr, rows, grads, *state.of(layer), grad_rows=grad_rows)
            self.decay(step, lr, state, layer, untouched)
            return
        at = rows
        if grad_rows is not None:  # the row of each gradient, in the gradients' order: no gather of gradients
            at = torch.empty_like(rows)
            at[grad_rows] = rows
        if untouched.numel():
            at, grads = torch.cat([at, untouched]), torch.cat([grads, grads.new_zeros(untouched.numel(), grads.shape[1])])
        if at.numel():
            self._fused(step, lr, state, layer, at, grads)

    def decay(self, step: int, lr: float, state: RowState, layer: int, rows: torch.Tensor) -> None:
        """Step ``step`` at ``lr`` on ``layer``'s ``rows`` (sorted) with a zero gradient (dense Adam's untouched rows)."""
        if not rows.numel():
            return
        if self.kernel == "rows" and self.spec.lean:
            self.adam.lean_rows(step, lr, layer, rows, self.token_ids(rows), None, *state.of(layer), None, self.seed,
                                self.col0)
        elif self.kernel == "rows":
            self.adam.update_untouched_rows(step, lr, rows, *state.of(layer))
        else:
            zeros = state.master[layer].new_zeros(rows.numel(), state.master[layer].shape[1])
            self._fused(step, lr, state, layer, rows, zeros)

    def _fused(self, step: int, lr: float, state: RowState, layer: int, at: torch.Tensor, grads: torch.Tensor) -> None:
        """torch's fused AdamW (or the lean update) on ``layer``'s rows ``at`` (host indices): gathered on the device,
        updated, put back (3x an in-place row kernel's traffic, ~10 ms a step at 1B STEM-1/3 on an H100 by
        docs/gpu_step_v2.md)."""
        tensors, rows = state.of(layer), copy_to_device(at, self.device)
        if self.spec.lean:
            self._lean(step, lr, layer, tensors, rows, copy_to_device(self.token_ids(at), self.device), grads)
        else:
            self._adamw(step, lr, tensors, rows, grads)

    def _lean(self, step: int, lr: float, layer: int, tensors: tuple, at: torch.Tensor, tokens: torch.Tensor,
              grads: torch.Tensor) -> None:
        """The lean update's torch definition on the device's rows ``at`` (token ids ``tokens``), by chunks."""
        constants = lean_adam.scalars(step, lr, (self.adam.beta1, self.adam.beta2), self.adam.eps,
                                      self.adam.weight_decay)
        for lo in range(0, at.numel(), self.LEAN_CHUNK):
            rows = at[lo:lo + self.LEAN_CHUNK]
            new = lean_adam.update(constants, self.seed, step, layer, self.col0, tokens[lo:lo + self.LEAN_CHUNK],
                                   grads[lo:lo + self.LEAN_CHUNK], *(t.index_select(0, rows) for t in tensors))
            for tensor, values in zip(tensors, new):
                tensor.index_copy_(0, rows, values)

    def _adamw(self, step: int, lr: float, tensors: tuple, at: torch.Tensor, grads: torch.Tensor) -> None:
        """torch's fused AdamW on the device's rows ``at``."""
        p, m, v = (t.index_select(0, at) for t in tensors)
        count = torch.full((), float(step), device=self.device)  # bias correction by the global step
        adam = self.adam
        torch._fused_adamw_([p], [grads.contiguous()], [m], [v], [], [count], lr=lr, beta1=adam.beta1,
                            beta2=adam.beta2, weight_decay=adam.weight_decay, eps=adam.eps, amsgrad=False,
                            maximize=False)
        for tensor, rows in zip(tensors, (p, m, v)):
            tensor.index_copy_(0, at, rows)
