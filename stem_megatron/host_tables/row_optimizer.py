"""AdamW on STEM table rows: the one row optimizer every tier uses (docs/host_tables.md).

Semantics. ``lazy`` (default) updates only the rows a step touched: their moments and weights, with weight decay on
those rows only and bias correction by the global step (``torch.optim.SparseAdam`` / TF LazyAdam). ``dense`` runs
AdamW over every row with zero gradients for untouched rows: exactly the optimizer the paper describes (moments of
untouched rows decay, weight decay applies to all rows), at a cost that grows with V instead of touched rows.

Back ends, chosen once by where the rows are: ``rows``, DeepSpeed's CPU Adam kernel (AVX, multi-threaded C++) with
our row-indexed entry point (``csrc/row_adam.cpp``), in place on host rows, and on a working set's slots on CPU
(bitwise the host's values); ``fused``, torch's fused AdamW on a GPU's slots (the rows gathered, updated and put
back: other arithmetic, equal within fp32 rounding, tests/test_working_set.py states the bound).

The decay of the rows a dense step did not touch is its own schedule (``LaterDecay``): a working set's rows outside
it decay on the host beside the next step, in chunks, the rows the prefetch thread asks for first; rows that enter
the set before their decay ran take it in their slots (``MissedUpdate``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from stem_megatron.host_tables.row_state import RowState
from stem_megatron.host_tables.transfer import copy_to_device

_ids = itertools.count()  # one kernel state per RowAdam, in the op's own registry
_SOURCE = Path(__file__).parent / "csrc" / "row_adam.cpp"


def _kernel():
    """DeepSpeed's CPU Adam plus our row-indexed update, built by DeepSpeed's op builder (its flags and
    SIMD width detection) into ``extensions_root()`` on first use."""
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
        NAME = "stem_row_adam"

        def absolute_name(self):
            return f"stem_megatron.host_tables.{self.NAME}_op"

        def sources(self):
            return [str(_SOURCE)]  # includes DeepSpeed's csrc/adam/cpu_adam_impl.cpp

        def include_paths(self):
            return ["csrc/includes", "csrc/adam"]

        def cxx_args(self):
            return cached_cxx_args(extensions_root(), super().cxx_args)

    return RowAdamBuilder().load()


def extensions_root() -> Path:
    """Where the op is built and found: ``TORCH_EXTENSIONS_DIR`` when set, else the venv's own ``torch_extensions``
    (one build per venv, which `make setup` made). torch's default, ``~/.cache/torch_extensions``, is shared by every
    venv of the user, so a script run directly from another venv (or a node whose home is elsewhere) would rebuild
    the op there: about a minute of a GPU node's 16 cores."""
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

    def __del__(self):
        kernel = getattr(self, "kernel", None)
        if kernel is not None:
            kernel.destroy_adam(self.opt_id)


EMPTY = torch.empty(0, dtype=torch.int64)


class RowOptimizer:
    """AdamW (``RowAdam``'s hyperparameters) on rows of a ``RowState`` by the ``kernel`` back end (``rows``:
    DeepSpeed's, ``fused``: torch's, on ``device``); ``dense``: the recipe's dense Adam, where the caller passes the
    rows without a gradient as ``untouched``."""

    def __init__(self, adam: RowAdam, kernel: str, device: torch.device, dense: bool = False):
        if kernel not in ("rows", "fused"):
            raise ValueError(f"row optimizer kernel must be 'rows' or 'fused', got {kernel!r}")
        self.adam, self.kernel, self.device, self.dense = adam, kernel, device, dense

    def update(self, step: int, lr: float, state: RowState, layer: int, rows: torch.Tensor, grads: torch.Tensor,
               grad_rows: torch.Tensor | None = None, untouched: torch.Tensor = EMPTY) -> None:
        """Step ``step`` at ``lr`` on ``layer``'s ``rows`` of ``state`` (sorted, distinct; host indices) with gradient
        ``grads[grad_rows[i]]`` for ``rows[i]`` (``grads[i]`` without ``grad_rows``: the gradients stay where they
        landed), then on ``untouched`` (sorted) with a zero gradient, without a tensor of those zeros."""
        if self.kernel == "rows":
            if rows.numel():
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
            self._fused(step, lr, state, layer, copy_to_device(at, self.device), grads)

    def decay(self, step: int, lr: float, state: RowState, layer: int, rows: torch.Tensor) -> None:
        """Step ``step`` at ``lr`` on ``layer``'s ``rows`` (sorted) with a zero gradient (dense Adam's untouched rows)."""
        if not rows.numel():
            return
        if self.kernel == "rows":
            self.adam.update_untouched_rows(step, lr, rows, *state.of(layer))
        else:
            zeros = state.master[layer].new_zeros(rows.numel(), state.master[layer].shape[1])
            self._fused(step, lr, state, layer, copy_to_device(rows, self.device), zeros)

    def _fused(self, step: int, lr: float, state: RowState, layer: int, at: torch.Tensor, grads: torch.Tensor) -> None:
        """torch's fused AdamW on ``layer``'s rows ``at`` (on the device): gathered, updated, put back (3x an in-place
        row kernel's traffic, ~10 ms a step at 1B STEM-1/3 on an H100 by docs/gpu_step_v2.md)."""
        tensors = state.of(layer)
        p, m, v = (t.index_select(0, at) for t in tensors)
        count = torch.full((), float(step), device=self.device)  # bias correction by the global step
        adam = self.adam
        torch._fused_adamw_([p], [grads.contiguous()], [m], [v], [], [count], lr=lr, beta1=adam.beta1,
                            beta2=adam.beta2, weight_decay=adam.weight_decay, eps=adam.eps, amsgrad=False,
                            maximize=False)
        for tensor, rows in zip(tensors, (p, m, v)):
            tensor.index_copy_(0, at, rows)


class MissedUpdate(NamedTuple):
    """(dense Adam) The update that a step's entering rows, outside the set then, missed: its ``step`` and ``lr``,
    and ``on_host``, the host's zero-gradient update of sorted ids."""
    step: int
    lr: float
    on_host: Callable[[torch.Tensor], None]


# Dense Adam's decay of the rows outside a working set, beside the next step. A row the step after reads can load
# into the set ahead (``WorkingSet.preload``) only once its decay of the step before is done; run in one piece, that
# decay (every row a rank owns: 126 GB of passes a step at 1B on one GPU, docs/gpu_step_v2.md) ends about when the
# next step does, too late to load anything ahead. So it runs in chunks, the prefetch thread's rows first; each row is
# decayed once, by the same elementwise kernel: bitwise the values of one piece.
CHUNK_ELEMENTS = 1 << 24  # a chunk's elements over the layers, what an asker may wait for (~30 ms at 1B: gpu_step_v2)


class LaterDecay:
    """The rows whose decay is due (``expect``, training thread), run on the Adam thread (``run``) while the
    prefetch thread waits for the ones it reads (``wait_for``)."""

    def __init__(self, vocab_size: int, row_elements: int):
        """``row_elements``: a row's elements over every layer decayed together (columns x layers)."""
        self.chunk = max(1, CHUNK_ELEMENTS // max(1, row_elements))
        self._due = torch.zeros(vocab_size, dtype=torch.bool)  # rows expected and not yet decayed
        self._asked = torch.empty(0, dtype=torch.int64)
        self._failed = False
        self._changed = threading.Condition()
        self.stats = self.new_stats()

    @staticmethod
    def new_stats() -> dict:
        """Rows whose decay the prefetch thread asked for (ahead of their turn) and its seconds waiting for them."""
        return dict(decay_rows_asked=0, decay_wait_s=0.0)

    def expect(self, ids: torch.Tensor) -> None:
        """(training thread, before queueing ``run``) ``ids`` are due: a ``wait_for`` them waits for their decay."""
        with self._changed:
            self._due[ids] = True
            self._failed = False

    def run(self, ids: torch.Tensor, decay: Callable[[torch.Tensor], None]) -> None:
        """(Adam thread) ``decay`` the sorted ``ids`` (expected) in chunks, asked rows first."""
        done = 0
        try:
            while True:
                with self._changed:
                    asked, self._asked = self._asked, torch.empty(0, dtype=torch.int64)
                    chunk = torch.unique(asked[self._due[asked]])
                    while not chunk.numel() and done < ids.numel():  # the next chunk, less rows asked earlier
                        chunk = ids[done:done + self.chunk]
                        chunk, done = chunk[self._due[chunk]], done + self.chunk
                if not chunk.numel():
                    return
                decay(chunk)
                with self._changed:
                    self._due[chunk] = False
                    self._changed.notify_all()
        except BaseException:
            with self._changed:
                self._failed = True
                self._due.fill_(False)
                self._changed.notify_all()
            raise

    def wait_for(self, ids: torch.Tensor) -> None:
        """(prefetch thread) Until none of ``ids`` is due, those asked for decaying next; raises where ``run``
        failed (its error reaches the training thread too)."""
        with self._changed:
            due = ids[self._due[ids]]
            if not due.numel():
                return
            start = time.perf_counter()
            self._asked = torch.cat([self._asked, due])
            self.stats["decay_rows_asked"] += due.numel()
            while self._due[due].any():
                self._changed.wait()
            self.stats["decay_wait_s"] += time.perf_counter() - start
            if self._failed:
                raise RuntimeError("the dense decay of the step before failed on the Adam thread (its error is "
                                   "raised in the training thread)")
