"""The host STEM tables as a member of megatron-core's ``ChainedOptimizer`` (``TableChain``), so a training step is
megatron's ``optimizer.step()`` whatever holds the tables (docs/host_tables.md, "The tables in megatron's optimizer").

The chain calls its members in one order (``prepare_grads``, the norm, its clip, ``step_with_ready_grads``); this
member maps them onto the step's end in the store's training ``RowPipeline`` (given at construction, open while a
training stream is): the row gradients sent to their owners and their squared norm summed (``reduce_gradients``, the
role of DDP's ``finish_grad_sync``), the clip, the rows updated and the next step released (``step``).

Three things the chain does not do for host rows, done here:
- The clip. The rows are not parameters (they live in host memory or the working set's slots), so ``get_parameters``
  is empty and the chain clips the dense parameters only. This member clips the rows itself with megatron's
  coefficient, ``clip_grad / (norm + 1e-6)``, by the joint norm (``host_tables.clip=global``, computed as the chain
  does) or the rows' own (``separate``, the released code's). For ``separate`` it reports a norm of 0 to the chain, so
  the chain's norm, which clips the dense gradients, is the dense norm alone.
- The dense norm. The member needs it for the joint clip and the step record, and megatron's chain keeps its members'
  norms to itself, so ``TableChain`` asks the dense optimizer once and gives its norm to the member (``norm_given``):
  asking it again would be a second pass over the dense gradients and a second all-reduce, and without TE or Apex
  megatron's L2 norm syncs the host once per parameter.
- A skipped update. The chain skips every member's ``step_with_ready_grads`` where a member finds a gradient that is
  not finite (the rows': ``prepare_grads``) or the norm is above ``grad_norm_skip_threshold``; ``TableChain`` skips it
  on a norm that is not finite too (megatron's found-inf skip, which its dense optimizers do only with a loss scaler),
  and on a step the training loop does not apply (``TableChain.skip``). The rows' step also releases the next step to
  the prefetch thread, so a step not applied ends in ``skip``: the rows and moments as they were, the next step's rows
  made readable and released (``RowPipeline.skip``). Every rank takes the same way: the norm and the loss are
  all-reduced.

The tables' state is checkpointed through this member (``sharded_state_dict``, ``load_state_dict``) in a directory of
its own (``checkpoint/host_tables.py``: each node writes its owners' rows), so the dense checkpoint keeps the layout
megatron gives the dense optimizer alone (``FiniteChain.dense``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core.optimizer import MegatronOptimizer
from torch.profiler import record_function

from stem_megatron.host_tables.store import CHECKPOINT_KINDS, HostTableStore
from stem_megatron.training.finite_chain import FiniteChain


class TableOptimizer(MegatronOptimizer):
    """The host tables' rows, updated by the store's row optimizer as a member of megatron's chain after ``dense``
    (megatron's optimizer of the dense parameters, whose config it shares). ``clip``: ``host_tables.clip``."""

    hosted = True  # a checkpoint has a ``stem/`` part (``checkpoint/host_tables.py``)

    def __init__(self, store: HostTableStore, dense: MegatronOptimizer, clip: str = "global"):
        if clip not in ("global", "separate"):
            raise ValueError(f"host_tables.clip must be 'global' or 'separate', got {clip!r}")
        # no torch optimizer to wrap (MegatronOptimizer.__init__ would warn that this rank has none): its attributes
        self.optimizer, self.config, self.is_stub_optimizer = None, dense.config, False
        self.store, self.pipeline, self.dense, self.separate = store, store.pipeline, dense, clip == "separate"
        # the LR scheduler sets this group's lr as it sets the dense groups'; the rows' decay is the store's
        self._groups = [{"params": [], "lr": dense.config.lr, "weight_decay": dense.config.weight_decay}]
        self.step_record: dict = {}  # the step's norms, for the training loop's record
        self._stem_sq: Optional[float] = None  # the reduced row gradients' squared norm

    @property
    def param_groups(self) -> list[dict]:
        return self._groups

    @property
    def state(self) -> dict:
        """No per-parameter state: the rows' moments are the store's."""
        return {}

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """The row gradients at their owners, DP-averaged; True if their norm is not finite."""
        with record_function("stem: reduce row gradients"):  # labels for a profiled step (logging.profile_step)
            self._stem_sq = float(self._pipeline().reduce_gradients())
        self.step_record = {}
        return not math.isfinite(self._stem_sq)

    @torch.no_grad()
    def norm_given(self, dense_norm) -> float:
        """The rows' norm for the chain, given the dense optimizer's (``TableChain``): ‖STEM‖, or 0 with ``separate``
        (the chain's norm, which clips the dense part, is then the dense one). Records the step's norms."""
        dense, stem = float(dense_norm), math.sqrt(self._stem_sq)
        joint = math.sqrt(sum(x**2 for x in (dense, stem)))  # as the chain sums its members' norms
        self.step_record = {"grad_norm": joint, "dense_grad_norm": dense, "stem_grad_norm": stem}
        return 0.0 if self.separate else stem

    def get_grad_norm(self) -> float:
        """A chain that asks its members alone has no dense norm to give this one."""
        raise TypeError("TableOptimizer takes the dense norm from its chain: chain it with TableChain(dense, tables) "
                        "(training/setup.py), not megatron's ChainedOptimizer")

    def get_grad_stats_parallel_group(self) -> None:
        """None: the rows' statistics are reduced by the tables themselves (over the DP group, then the model-parallel
        group: ``RowGradients.finish_grad_sync``), so the chain sums its members' norms instead of their gradients'."""
        return None

    def has_grad_norm_group(self, grad_norm_group: str) -> bool:
        """False: the rows are in none of megatron's separate norm groups (known here, without its world
        all-reduce)."""
        return False

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """The rows clipped (megatron's coefficient, by the norm ``host_tables.clip`` names), updated at this group's
        lr, and the next step's rows made readable and released."""
        pipeline, clip = self._pipeline(), self.config.clip_grad
        if clip > 0.0:
            norm = self.step_record["stem_grad_norm" if self.separate else "grad_norm"]
            coef = clip / (norm + 1.0e-6)
            if coef < 1.0:
                pipeline.scale_gradients(coef)
        with record_function("stem: CPU Adam + refresh"):
            pipeline.step(self.param_groups[0]["lr"])
        return True

    @torch.no_grad()
    def skip(self) -> None:
        """The step not applied: the rows and moments as they were, the next step's rows readable and released."""
        self._pipeline().skip()

    def _pipeline(self):
        if not self.pipeline.is_open:
            raise RuntimeError("a step with host STEM tables ran outside their stream: read the batches through "
                               "HostTableStore.stream (training/data_stream.py), whose pipeline ends each step")
        return self.pipeline

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: each step's row gradients are its own (``RowGradients``), let go as the step ends."""

    def get_loss_scale(self) -> torch.Tensor:
        return self.dense.get_loss_scale()

    def reload_model_params(self, state_dict=None) -> None:
        """Nothing: the rows have no copy apart from their master rows (a checkpoint's load refreshes them)."""

    def state_dict(self) -> dict:
        """The Adam step count: the rows and moments are saved by their owners (``sharded_state_dict``)."""
        return {"steps_done": self.pipeline.steps_done}

    def load_state_dict(self, state_dict: dict) -> None:
        """After ``sharded_state_dict(is_loading=True)``'s tensors were filled from a checkpoint: every node's copy of
        the rows from their owners and, resuming, the Adam step count ``steps_done``; without it, a new run from the
        checkpoint's tables (``HostTableStore.restore``; collective over the world)."""
        self.store.restore(state_dict.get("steps_done"))

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False,
                           kinds: tuple[str, ...] = CHECKPOINT_KINDS, **kwargs) -> dict:
        """The master rows and both ``kinds`` of moments (saving: once the last step's updates are done), one global
        tensor a layer and kind in the ownership order (``HostTableStore.sharded_state_dict``;
        ``checkpoint/host_tables.py`` saves them in a directory of their own)."""
        if not is_loading:
            self.store.settle()
        return self.store.sharded_state_dict(kinds, loading=is_loading)

    def step(self):
        """Megatron's steps go through the chain: a member alone has no dense norm to clip by."""
        raise TypeError("TableOptimizer is stepped as a member of its TableChain (training/setup.py)")


class TableChain(FiniteChain):
    """megatron's chain of the dense optimizer and the tables' member, whose norm asks the dense optimizer once and
    gives it to the member (``TableOptimizer.norm_given``) rather than have the member ask again; a step whose norm is
    not finite changes nothing (``FiniteChain``; see the module's docstring on skipped updates)."""

    def __init__(self, dense: MegatronOptimizer, tables: TableOptimizer):
        super().__init__([dense, tables])
        self.tables = tables

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """megatron's norm of members whose statistics are reduced apart (the tables' are: their
        ``get_grad_stats_parallel_group`` is None), computed as megatron does: the root of their squares' sum."""
        dense, tables = self.chained_optimizers
        dense_norm = dense.get_grad_norm()
        norms = [norm if norm else 0.0 for norm in (dense_norm, tables.norm_given(dense_norm))]
        self._norm = math.sqrt(sum([x**2 for x in norms]))
        return self._norm

    @torch.no_grad()
    def step(self):
        """megatron's step; one it does not apply ends in the tables' ``skip``."""
        applied, norm, zeros = super().step()
        if not applied:
            self.tables.skip()
        return applied, norm, zeros

    @torch.no_grad()
    def skip(self) -> tuple[bool, None, None]:
        """``FiniteChain.skip``, the step's row gradients reduced as every step's are (among the step's collectives
        on every rank), then the tables' ``skip``."""
        self.tables.prepare_grads()
        self.tables.skip()
        return False, None, None
