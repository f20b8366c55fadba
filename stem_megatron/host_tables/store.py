"""The host-resident STEM table store of one rank: storage, row fetches, step gradients, updates.

Placement (``ownership.RowOwnership``): every node keeps a copy of each ``U_l`` of this pipeline stage
(``node.shared_tensors``, TP-major ``[tp, V, d_ff/tp]`` so a TP rank's column slice is one contiguous
``[V, d_ff/tp]`` block), rows in the ownership permutation's order, fp32 or bf16 (``read_dtype``). Each
row has one owner node, which keeps the fp32 master row and its Adam moments, in a block of the owner's
rows ``[tp, V/N, d_ff/tp]``: with fp32 copies the master block is the owned range of the node's copy
itself, with bf16 copies a block of its own. The other nodes' copies of a row are refreshed from the
owner just before they are read.

A step, as driven by the training loop and the prefetcher:
1. ``fetch`` (prefetch thread): rows of a micro-batch's unique ids from the node's copy, which
   ``refresh`` made current for exactly these ids before the prefetcher was released.
2. ``begin_step`` and ``register`` (forward of ``HostRowSource``): the compact row tensor whose ``.grad``
   backward fills, merged into the step's gradients as it does (``step_pipeline.RowGradients``).
3. ``reduce_gradients``: every layer's gradients at their owners, averaged over DP, on the host; the
   squared norm for global clipping.
4. ``step``: CPU Adam on the rows this rank owns, the rows any rank reads next first, then ``refresh``
   for the next step's ids: rows updated elsewhere that this node reads next are pulled from their owners
   (rows read in step s+1 reflect step s); the other rows are updated while the next step runs
   (``step_pipeline.RowUpdates``).
With a working set (``stem.resident_rows``) the rows a step reads stay on the device with their state instead
(``working_set.WorkingSet``): steps 1, 3 and 4 read, keep and update them there. At DP > 1 each rank's set holds the
rows it owns that the group reads next, and the others get them from it (``step_rows.StepRows``).
"""

from __future__ import annotations

import secrets
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from stem_megatron.config import RunConfig
from stem_megatron.host_tables.cache import HotRowCache
from stem_megatron.host_tables.exchange import DTYPES, RowExchange
from stem_megatron.host_tables.node import SHM_DIR, host_threads, node_layout, shared_tensors
from stem_megatron.host_tables.ownership import RowOwnership
from stem_megatron.host_tables.pinned import cache_staging_bytes, landed, landing_rows, staging_bytes
from stem_megatron.host_tables.resident_step import ResidentRows
from stem_megatron.host_tables.row_adam import RowAdam
from stem_megatron.host_tables.step_pipeline import RowGradients, RowUpdates
from stem_megatron.host_tables.transfer import HostToDevice, PrefetchedRows, fetch_rows, travel_dtype
from stem_megatron.host_tables.whole_tables import WholeTables
from stem_megatron.layer_plan import planned_layers
from stem_megatron.model.device_table import table_init_std

MOMENTS = ("exp_avg", "exp_avg_sq")


class HostTableStore(WholeTables, ResidentRows):
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
        host_memory_gib: Optional[float] = None,
        wire_dtype: str = "fp32",
        read_dtype: str = "fp32",
        overlap: bool = True,
        overlap_update: bool = True,
        compute_dtype: Optional[torch.dtype] = None,
        micro_batch_tokens: int = 0,
        micro_batches: int = 1,
        resident_rows: int = 0,
    ):
        """Collective over the world (node and exchange groups and the shared tables are created here).
        ``micro_batch_tokens`` (b * s) and ``micro_batches`` (a step's, per DP rank) size the pinned staging
        and landing buffers on GPU before the first step (``pinned``; 0: sized by the first steps).
        ``resident_rows``: the working set's slots a layer (0: none, rows fetched from the host every step)."""
        if optimizer not in ("lazy", "dense"):
            raise ValueError(f"stem.optimizer must be 'lazy' or 'dense', got {optimizer!r}")
        self.layers = list(layers)  # global 1-based layer numbers of this stage's STEM layers
        self.vocab_size, self.d_ff, self.mode = vocab_size, d_ff, optimizer
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.cols = d_ff // self.tp
        self.device = device or torch.device("cpu")
        self.dp_group = parallel_state.get_data_parallel_group()
        self.node = node_layout(dist.get_process_group_ranks(self.dp_group),
                                planning=bool(resident_rows))  # (``plan_ahead``)
        n = self.node
        self.own = RowOwnership(vocab_size, n.dp_nodes, n.dp_node, len(n.local_dp_peers), n.peer_index)
        self.exchange = RowExchange(self.own, n, self.device, wire_dtype)
        run_id = [secrets.token_hex(6) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(run_id, src=0)
        self.read_dtype = DTYPES[read_dtype]
        own, fp32 = self.own.owned_rows, torch.float32
        specs = {"weight": (vocab_size, self.read_dtype), "exp_avg": (own, fp32), "exp_avg_sq": (own, fp32)}
        if self.read_dtype != fp32:
            specs["master"] = (own, fp32)
        self._names = {(layer, kind): f"stem-{run_id[0]}-n{n.node}-L{layer}-{kind}"
                       for layer in self.layers for kind in specs}
        by_name = {name: key for key, name in self._names.items()}

        def init(name: str, tensor: torch.Tensor) -> None:
            layer, kind = by_name[name]
            if kind in ("weight", "master"):
                self._init_table(tensor, layer, seed, init_std, owned=kind == "master")
            # moments: tmpfs pages start at zero

        shared = shared_tensors({name: ((self.tp, specs[kind][0], self.cols), specs[kind][1])
                                 for (_, kind), name in self._names.items()}, n.group, init, directory=shm_dir,
                                host_memory_gib=host_memory_gib)
        self.full = {key: shared[name] for key, name in self._names.items()}  # [tp, rows, cols], node-shared
        self.weight = {layer: self.full[layer, "weight"][self.tp_rank] for layer in self.layers}  # position order
        self.master = {layer: self.full[layer, "master"][self.tp_rank] if "master" in specs
                       else self.weight[layer][self.own.lo:self.own.hi] for layer in self.layers}
        self.exp_avg = {layer: self.full[layer, "exp_avg"][self.tp_rank] for layer in self.layers}
        self.exp_avg_sq = {layer: self.full[layer, "exp_avg_sq"][self.tp_rank] for layer in self.layers}
        # rows of my class in my node's copy that equal their owner's (rows my node owns always do)
        self.current = torch.ones(vocab_size, dtype=torch.bool)
        self.adam = RowAdam(betas, eps, weight_decay)
        self.cache = HotRowCache(cache_rows, vocab_size, self.device)
        travel = travel_dtype(self.read_dtype, compute_dtype)
        step_ids = dist.get_world_size(self.dp_group) * min(vocab_size, micro_batches * micro_batch_tokens)
        moving = min(resident_rows, landing_rows(self.own, step_ids))  # rows entering the working set at once
        self._init_resident(resident_rows, optimizer, travel, moving, micro_batch_tokens)
        travel = travel.itemsize
        rows = min(vocab_size, micro_batch_tokens)  # distinct ids of a micro-batch, at most
        slot_bytes = max(staging_bytes(len(self.layers), rows, self.cols, travel, micro_batch_tokens) if rows else 0,
                         cache_staging_bytes(self.cache.capacity, self.cols, travel))
        self.h2d = HostToDevice(self.device, dtype=compute_dtype, slot_bytes=slot_bytes)
        self._row_bytes = self.cols * travel  # as rows travel
        self.steps_done = 0
        self.grads = RowGradients(self.layers, self.cols, self.exchange, self.dp_group, self.device, overlap,
                                  landing_rows=landing_rows(self.own, step_ids), to_host=self.resident is None)
        self.updates = RowUpdates(overlap_update, host_threads(self.device), self.device)
        self._grads: dict = {}  # layer -> (ids, gradients, copy event) of the step, on the host
        self._aside: dict = {}  # layer -> the later part's gradients, out of the landing buffer (``_set_aside``)
        self._stats = self._new_stats()

    def restore_step(self, steps_done: int) -> None:
        """After loading a checkpoint (every node holds every row): continue the Adam step count."""
        self.settle()
        self.steps_done = steps_done
        self.current.fill_(True)
        self.drop_resident()
        self.cache.choose(steps_done)
        self._reload_cache()

    def settle(self) -> None:
        """Wait for the last step's CPU Adam (``step_pipeline.RowUpdates``) here and on this rank's DP peers on
        the node (their rows share its copy of this TP block): call before reading tables or moments whole.
        Collective over those peers (``node.local``), not the node: other TP ranks and stages need not call it.
        With a working set, its rows' state is written back first."""
        self.updates.settle()
        if self.resident is not None:
            self.resident.write_back()
        if self.node.local is not None:
            dist.barrier(self.node.local)

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory this rank's node holds for this stage's tables and moments."""
        return sum(t.numel() * t.element_size() for t in self.full.values())

    # ---- prefetch side (background thread) ----
    def fetch(self, tokens: torch.Tensor, step_ids: Optional[torch.Tensor] = None,
              training: bool = True) -> PrefetchedRows:
        """Rows ``U_l[unique ids, my columns]`` of every local STEM layer for a micro-batch's ``tokens``,
        on their way to the compute device (``transfer.fetch_rows``); training passes the ``step_ids``
        (sorted) of the micro-batch's step, and with a working set gets the rows' slots there instead (at DP > 1
        their positions among the step's rows received from the owners)."""
        if training and self.resident is not None and step_ids is not None:
            return self.resident.fetch(tokens, step_ids, by_position=self.step_rows is not None)
        prefetched, hit = fetch_rows(tokens, self.vocab_size, self.weight, self.cache, self.h2d,
                                     at=self.own.position, step_ids=step_ids)
        uniq, misses = prefetched.uniq.numel(), int((~hit).sum())
        row_bytes = self._row_bytes
        prefetched.fetched.stats.update(
            unique_tokens=uniq, rows_fetched=misses * len(self.layers),
            bytes_to_device=misses * row_bytes * len(self.layers),
            cache_hits=uniq - misses, cache_lookups=uniq if self.cache.ids.numel() else 0)
        return prefetched

    # ---- training side ----
    def count(self, stats: dict) -> None:
        """Add a consumed micro-batch's fetch counters to this step's metrics (training thread)."""
        for key, value in stats.items():
            self._stats[key] += value

    def begin_step(self, micro_batches: int, ids: torch.Tensor) -> None:
        """A training step of ``micro_batches`` that reads the sorted ``ids`` (the prefetcher's announcement)
        starts."""
        planned, self._planned = self._planned, None
        plan = planned[1] if planned is not None and torch.equal(planned[0], ids) else None
        self.grads.begin(ids, micro_batches, plan)

    def register(self, layer: int, prefetched: PrefetchedRows, rows: torch.Tensor) -> None:
        """A micro-batch's compact rows (its distinct ids x columns) whose ``.grad`` backward fills."""
        self.grads.track(layer, prefetched.in_step, rows)

    def reduce_gradients(self) -> torch.Tensor:
        """Every layer's gradients at their owners (DP-averaged, landing on the host); returns the squared
        norm of the STEM gradients summed over DP, TP and PP (each row counted once)."""
        self._grads, sq = self.grads.reduce()
        return sq

    def scale_gradients(self, coef: float) -> None:
        for _, grads, event in self._grads.values():
            landed(event)
            grads.mul_(coef)

    def step(self, lr: float, next_ids: torch.Tensor) -> None:
        """CPU Adam on the rows this rank owns, then ``refresh`` for ``next_ids`` (the ids this rank reads
        in the next step) and the hot-row cache. Rows any rank of the DP group reads next are updated before
        the refresh; the others after it, beside the next step (``stem.overlap_update``)."""
        self.updates.settle()  # this rank's rows and moments: no other rank writes them
        step = self.steps_done + 1
        if self.resident is not None:
            return self._step_resident(step, lr, next_ids)
        self.cache.choose(step)
        reads = torch.cat([next_ids, self.cache.ids])
        read_next = self._read_next(reads)
        first, rest, updated = [], [], torch.empty(0, dtype=torch.int64)
        if self.mode == "dense":  # every row this rank owns, the same for every layer
            rows = self.own.my_local()
            now = read_next[self.own.ids_at(self.own.lo + rows)]
        for layer in self.layers:
            ids, grads, event = self._grads.pop(layer, (torch.empty(0, dtype=torch.int64),
                                                        torch.empty(0, self.cols), None))
            landed(event)
            updated = torch.unique(torch.cat([updated, ids]))
            local, read = self.own.local(ids), read_next[ids]
            order = torch.argsort(local + (~read) * self.vocab_size)  # rows read next first, each part by row
            local, k = local[order], int(read.sum())  # the gradients stay as they landed: ``order`` finds them
            if self.mode == "dense":  # zero gradients for the untouched ones
                first.append((layer, rows[now], local[:k], grads, order[:k]))
                rest.append((layer, rows[~now], local[k:], grads, order[k:]))
            else:
                first.append((layer, local[:k], local[:k], grads, order[:k]))
                rest.append((layer, local[k:], local[k:], grads, order[k:]))
            self._stats["rows_updated"] += first[-1][1].numel() + rest[-1][1].numel()
            self._stats["rows_updated_later"] += rest[-1][1].numel()

        def update(parts) -> None:
            for layer, rows, local, grads, at in parts:
                self._update(step, lr, layer, rows, local, grads, at)

        def update_now() -> None:
            """The first part, then the rest's gradients out of the landing buffers (the next step's land there)
            into buffers kept from step to step, on the same thread and its cores: the first part reads them where
            they landed, with no copy."""
            update(first)
            rest[:] = [(layer, rows, local, self._set_aside(layer, grads, at), None)
                       for layer, rows, local, grads, at in rest]

        self.updates.now(update_now)
        self.steps_done = step
        if self.layers:
            if self.mode == "dense":
                self.current.fill_(False)  # every row changed (the owned ones are never asked for)
            else:
                self.current[self.exchange.updated_elsewhere(updated)] = False
        self.refresh(reads)
        self._reload_cache()
        self.updates.later(lambda: update(rest))

    def _read_next(self, ids: torch.Tensor) -> torch.Tensor:
        """Over token ids: True where any rank of the DP group reads the row in the next step (every row
        without ``stem.overlap_update``: one part, the serial order). Collective over the DP group."""
        if not self.updates.overlapped:
            return torch.ones(self.vocab_size, dtype=torch.bool)
        return self.exchange.read_anywhere(ids, self.vocab_size)

    def _set_aside(self, layer: int, grads: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """``grads[at]`` in this layer's buffer for the later part, grown when too small (a fresh tensor each step
        would fault its pages in on the step's path)."""
        buffer = self._aside.get(layer)
        if buffer is None or buffer.shape[0] < at.numel():
            buffer = self._aside[layer] = torch.empty(at.numel(), self.cols)
        return torch.index_select(grads, 0, at, out=buffer[:at.numel()])

    def _update(self, step: int, lr: float, layer: int, rows, local, grads, at) -> None:
        """AdamW on rows ``rows`` (sorted, of the node's master block) of ``layer``: gradient ``grads[at[i]]``
        for ``local[i]`` (sorted, among ``rows``), zero for the others (dense mode), without a tensor of those
        zeros (V x cols a step)."""
        if rows.numel() == 0:
            return
        table = self.master[layer], self.exp_avg[layer], self.exp_avg_sq[layer]
        self.adam.update_rows(step, lr, local, grads, *table, grad_rows=at)
        if rows.numel() != local.numel():
            untouched = torch.ones(rows.numel(), dtype=torch.bool)
            untouched[torch.searchsorted(rows, local)] = False
            self.adam.update_untouched_rows(step, lr, rows[untouched], *table)
        if self.read_dtype != torch.float32:  # the node's copy of its own rows, rounded
            self.weight[layer][self.own.lo + rows] = self.master[layer][rows].to(self.read_dtype)

    def refresh(self, ids: torch.Tensor) -> None:
        """Make this node's copy of rows ``ids`` (any DP peer on the node may ask for its own) equal the
        owners' rows. Collective over the world's ranks of this stage's DP group and the node."""
        if self.resident is not None:  # its rows written back: this reads the host copy
            self.settle()
        else:
            self.updates.settle()  # the peers' too before anyone reads: the barrier below
        if self.layers:
            need = self.exchange.node_needs(ids)
            stale = need[~self.current[need] & (self.own.owner(need) != self.own.node)]
            self.exchange.pull(stale, [self.weight[layer] for layer in self.layers])
            self.current[stale] = True
            self._stats["rows_pulled"] += stale.numel()
        dist.barrier(self.node.group)  # every peer's pulled rows are in the node's copy before anyone reads

    def _reload_cache(self) -> None:
        """Re-read the hot rows (the step changed nearly all of them), on the side stream the next fetch reads
        them on."""
        self.cache.reload(self.weight, self.h2d, self.own.position)

    # ---- metrics ----
    @staticmethod
    def _new_stats() -> dict:
        return dict(unique_tokens=0, rows_fetched=0, bytes_to_device=0, rows_updated=0, rows_updated_later=0,
                    rows_pulled=0, cache_hits=0, cache_lookups=0)

    def take_stats(self) -> dict:
        """This step's counters (prefixed ``stem_``), reset for the next step: ``stem_bytes_sent`` by this
        rank to its DP peers anywhere; ``stem_node_*`` for this rank's node in total (bytes sent to and
        received from other nodes, table rows Adam updated, each layer counted), a collective over the node."""
        stats, self._stats = self._stats, self._new_stats()
        parts = (self.grads, self.updates, self.resident, self.step_rows, self.later_decay)
        for part in [p for p in parts if p is not None]:
            stats.update(part.stats)
            part.stats = part.new_stats()
        wire, self.exchange.stats = self.exchange.stats, self.exchange.new_stats()
        node = torch.tensor([wire["inter_node_sent"], wire["inter_node_received"], stats.pop("rows_updated") / self.tp],
                            dtype=torch.float64)
        dist.all_reduce(node, group=self.node.group)
        hits, lookups = stats.pop("cache_hits"), stats.pop("cache_lookups")
        out = {f"stem_{k}": v for k, v in stats.items()}
        out.update(stem_bytes_sent=wire["bytes_sent"], stem_node_bytes_sent=int(node[0]),
                   stem_node_bytes_received=int(node[1]), stem_node_rows_updated=round(float(node[2])),
                   stem_exchange_s=wire["exchange_s"])
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
        host_memory_gib=cfg.stem.host_memory_gib,
        wire_dtype=cfg.stem.wire_dtype, read_dtype=cfg.stem.read_dtype, overlap=cfg.stem.overlap_exchange,
        overlap_update=cfg.stem.overlap_update, compute_dtype=tconfig.params_dtype,
        micro_batch_tokens=t.micro_batch_size * m.seq_length,
        micro_batches=t.global_batch_size // (t.micro_batch_size * parallel_state.get_data_parallel_world_size()),
        resident_rows=cfg.stem.resident_rows,
    )
