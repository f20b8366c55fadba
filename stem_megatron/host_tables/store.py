"""The host-resident STEM table store of one rank: storage, row fetches, step gradients, updates.

Placement: for each STEM layer of this pipeline stage, ``U_l`` and its two Adam moments live in host
memory, one copy per node (``node.shared_tensors``), laid out TP-major as ``[tp, V, d_ff/tp]`` so this
TP rank's column slice is one contiguous ``[V, d_ff/tp]`` block. DP replicas on other nodes hold
identical copies, kept identical by applying the same averaged gradients.

A step, as driven by the training loop:
1. ``fetch`` (prefetch thread): rows of the micro-batch's unique ids, after waiting until the previous
   step's update is visible (``wait_for_step``): rows read for step s+1 always reflect step s.
2. ``register`` (forward of ``HostRowSource``): the compact row tensor whose ``.grad`` backward fills.
3. ``reduce_gradients``: per layer, merge the micro-batches' compact gradients by id, DP-average them
   over the union of touched ids (``dp_sync``), return the squared norm for global clipping.
4. ``step``: CPU Adam on this rank's share of the touched rows (DP peers on the node split the rows),
   node barrier, refresh the hot-row cache, publish the new version to the prefetcher.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from stem_megatron.config import RunConfig
from stem_megatron.host_tables.cache import HotRowCache
from stem_megatron.host_tables.dp_sync import union_all_reduce
from stem_megatron.host_tables.node import SHM_DIR, node_layout, shared_tensors
from stem_megatron.host_tables.row_adam import RowAdam
from stem_megatron.host_tables.transfer import HostToDevice, PrefetchedRows, fetch_rows
from stem_megatron.layer_plan import planned_layers
from stem_megatron.model.device_table import table_init_std

_INIT_ROWS = 4096  # rows drawn per generator seed when initialising a table (fixes the init values)


class HostTableStore:
    def __init__(
        self,
        layers: list[int],
        vocab_size: int,
        d_ff: int,
        init_std: float,
        seed: int,
        optimizer: str = "lazy",
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        cache_rows: int = 0,
        device: Optional[torch.device] = None,
        shm_dir: str = SHM_DIR,
    ):
        """Collective over the world (node groups and the shared tables are created here)."""
        if optimizer not in ("lazy", "dense"):
            raise ValueError(f"stem.optimizer must be 'lazy' or 'dense', got {optimizer!r}")
        self.layers = list(layers)  # global 1-based layer numbers of this stage's STEM layers
        self.vocab_size, self.d_ff, self.mode = vocab_size, d_ff, optimizer
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.cols = d_ff // self.tp
        self.device = device or torch.device("cpu")
        self.dp_group = parallel_state.get_data_parallel_group()
        self.node = node_layout(dist.get_process_group_ranks(self.dp_group))
        run_id = [secrets.token_hex(6) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(run_id, src=0)
        self._names = {(layer, kind): f"stem-{run_id[0]}-n{self.node.node}-L{layer}-{kind}"
                       for layer in self.layers for kind in ("weight", "exp_avg", "exp_avg_sq")}
        by_name = {name: key for key, name in self._names.items()}

        def init(name: str, tensor: torch.Tensor) -> None:
            layer, kind = by_name[name]
            if kind == "weight":
                self._init_table(tensor, layer, seed, init_std)  # moments: tmpfs pages start at zero

        shared = shared_tensors(list(self._names.values()), (self.tp, vocab_size, self.cols), self.node.group, init,
                                directory=shm_dir)
        self.full = {key: shared[name] for key, name in self._names.items()}  # [tp, V, cols], node-shared
        self.weight = {layer: self.full[layer, "weight"][self.tp_rank] for layer in self.layers}
        self.exp_avg = {layer: self.full[layer, "exp_avg"][self.tp_rank] for layer in self.layers}
        self.exp_avg_sq = {layer: self.full[layer, "exp_avg_sq"][self.tp_rank] for layer in self.layers}
        self.adam = RowAdam(betas, eps, weight_decay)
        self.cache = HotRowCache(cache_rows, vocab_size, self.device)
        self.h2d = HostToDevice(self.device)
        self.steps_done = 0
        self._version = threading.Condition()
        self._pending: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {layer: [] for layer in self.layers}
        self._grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._stats = self._new_stats()

    def _init_table(self, full: torch.Tensor, layer: int, seed: int, std: float) -> None:
        """N(0, std) rows, the same on every node and for every TP size."""
        for start in range(0, self.vocab_size, _INIT_ROWS):
            g = torch.Generator().manual_seed(seed * 1_000_003 + layer * 7919 + start)
            rows = torch.randn(min(_INIT_ROWS, self.vocab_size - start), self.d_ff, generator=g) * std
            full[:, start:start + rows.shape[0]] = rows.view(rows.shape[0], self.tp, self.cols).transpose(0, 1)

    # ---- tables as whole matrices (tests, checkpoints) ----
    def table(self, layer: int) -> torch.Tensor:
        """``U_l`` as a V x d_ff copy (all TP blocks are in the node's shared file)."""
        full = self.full[layer, "weight"]
        return full.transpose(0, 1).reshape(self.vocab_size, self.d_ff).clone()

    def load_tables(self, tables: dict[int, torch.Tensor]) -> None:
        """Overwrite this rank's column block of each ``U_l`` from V x d_ff matrices (node collective)."""
        for layer, table in tables.items():
            self.weight[layer].copy_(table[:, self.tp_rank * self.cols:(self.tp_rank + 1) * self.cols])
        dist.barrier(self.node.group)

    def restore_step(self, steps_done: int) -> None:
        """After loading a checkpoint: continue the Adam step count and re-read the cached rows."""
        self.cache.refresh(steps_done, self.weight, None)
        self._publish(steps_done)

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory this rank's node holds for this stage's tables and moments."""
        return sum(t.numel() * t.element_size() for t in self.full.values())

    # ---- prefetch side (background thread) ----
    def wait_for_step(self, step: int, stop: threading.Event) -> None:
        """Block until the updates of every step before ``step`` are visible (exactness contract)."""
        with self._version:
            self._version.wait_for(lambda: self.steps_done >= step or stop.is_set())

    def _publish(self, steps_done: int) -> None:
        """Let the prefetcher read rows of the next step. The caller has written the tables and the hot-row
        cache; the cache writes are ordered before any fetch that follows (``HostToDevice.cache_written``)."""
        self.h2d.cache_written()
        with self._version:
            self.steps_done = steps_done
            self._version.notify_all()

    def wake_waiters(self) -> None:
        with self._version:
            self._version.notify_all()

    def fetch(self, tokens: torch.Tensor) -> PrefetchedRows:
        """Rows ``U_l[unique ids, my columns]`` of every local STEM layer for a micro-batch's ``tokens``,
        on their way to the compute device (``transfer.fetch_rows``)."""
        prefetched, hit = fetch_rows(tokens, self.vocab_size, self.weight, self.cache, self.h2d)
        uniq, misses = prefetched.uniq.numel(), int((~hit).sum())
        prefetched.fetched.stats.update(
            unique_tokens=uniq, rows_fetched=misses * len(self.layers),
            bytes_to_device=misses * self.cols * 4 * len(self.layers),
            cache_hits=uniq - misses, cache_lookups=uniq if self.cache.ids.numel() else 0)
        return prefetched

    # ---- training side ----
    def count(self, stats: dict) -> None:
        """Add a consumed micro-batch's fetch counters to this step's metrics (training thread)."""
        for key, value in stats.items():
            self._stats[key] += value

    def register(self, layer: int, uniq: torch.Tensor, rows: torch.Tensor) -> None:
        """Keep a micro-batch's compact rows; backward fills ``rows.grad`` (unique ids x columns)."""
        self._pending[layer].append((uniq, rows))

    def reduce_gradients(self) -> torch.Tensor:
        """Merge the step's compact gradients, DP-average them; returns the squared norm of this rank's
        STEM gradients summed over TP and PP (DP replicas hold identical gradients after the sync)."""
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for layer, items in self._pending.items():
            if not items:
                continue
            ids = torch.cat([u.to(self.device) for u, _ in items])
            grads = torch.cat([r.grad for _, r in items])
            merged, inverse = torch.unique(ids, return_inverse=True)
            compact = torch.zeros(merged.numel(), self.cols, device=self.device).index_add_(0, inverse, grads)
            union, compact, sent = union_all_reduce(merged, compact, self.dp_group)
            self._stats["bytes_from_device"] += grads.numel() * 4
            self._stats["sync_bytes"] += sent
            sq += compact.float().pow(2).sum()
            self._grads[layer] = (union.cpu(), compact.cpu())
            items.clear()
        dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
        return sq

    def scale_gradients(self, coef: float) -> None:
        for _, grads in self._grads.values():
            grads.mul_(coef)

    def step(self, lr: float) -> None:
        """CPU Adam on this rank's share of the rows, then publish the new tables to the prefetcher."""
        start = time.perf_counter()
        step = self.steps_done + 1
        peer, peers = self.node.peer_index, len(self.node.local_dp_peers)
        updated = {}
        for layer in self.layers:
            ids, grads = self._grads.pop(layer, (torch.empty(0, dtype=torch.int64), torch.empty(0, self.cols)))
            updated[layer] = ids
            if self.mode == "lazy":
                self.adam.update_rows(step, lr, ids.tensor_split(peers)[peer], grads.tensor_split(peers)[peer],
                                      self.weight[layer], self.exp_avg[layer], self.exp_avg_sq[layer])
            else:
                lo, hi = peer * self.vocab_size // peers, (peer + 1) * self.vocab_size // peers
                self._dense_update(layer, ids, grads, lo, hi, step, lr)
        dist.barrier(self.node.group)  # every peer's rows are written before anyone reads them
        self._stats["cpu_adam_s"] += time.perf_counter() - start
        self.cache.refresh(step, self.weight, updated if self.mode == "lazy" else None)
        self._publish(step)

    def _dense_update(self, layer, ids, grads, lo, hi, step, lr) -> None:
        dense = torch.zeros(hi - lo, self.cols)
        mine = (ids >= lo) & (ids < hi)
        dense[ids[mine] - lo] = grads[mine]
        self.adam.update(step, lr, self.weight[layer][lo:hi], dense,
                         self.exp_avg[layer][lo:hi], self.exp_avg_sq[layer][lo:hi])

    # ---- metrics ----
    @staticmethod
    def _new_stats() -> dict:
        return dict(unique_tokens=0, rows_fetched=0, bytes_to_device=0, bytes_from_device=0, sync_bytes=0,
                    cpu_adam_s=0.0, cache_hits=0, cache_lookups=0)

    def take_stats(self) -> dict:
        """This step's counters (prefixed ``stem_``), reset for the next step."""
        stats, self._stats = self._stats, self._new_stats()
        hits, lookups = stats.pop("cache_hits"), stats.pop("cache_lookups")
        out = {f"stem_{k}": v for k, v in stats.items()}
        out["stem_cache_hit_rate"] = hits / lookups if lookups else None
        out["stem_host_table_bytes"] = self.host_bytes
        return out


def build_store(cfg: RunConfig, tconfig: TransformerConfig, device: torch.device) -> HostTableStore:
    """The host tables of this pipeline stage's STEM layers (collective: every rank builds one)."""
    first = get_transformer_layer_offset(tconfig) + 1
    local = range(first, first + get_num_layers_to_build(tconfig))
    layers = [i + 1 for i in planned_layers(cfg.model.num_layers, cfg.stem) if i + 1 in local]
    t, m = cfg.train, cfg.model
    return HostTableStore(
        layers, m.vocab_size, m.ffn_hidden_size,
        table_init_std(tconfig, m.vocab_size, cfg.stem.table_init, cfg.stem.table_init_std), t.seed,
        optimizer=cfg.stem.optimizer, betas=(t.adam_beta1, t.adam_beta2), eps=1e-8,
        weight_decay=t.weight_decay, cache_rows=cfg.stem.cache_rows, device=device, shm_dir=cfg.stem.shm_dir,
    )
