"""Host-resident STEM tables of one rank: the public face (docs/host_tables.md).

``placement.build_tables`` makes one per rank (a collective) from a ``StoreConfig``: the node's host record of this
stage's tables (``row_state``), the row exchange across DP ranks and nodes (``exchange``), the row optimizer
(``row_optimizer``), the tier where the rows a step reads live, chosen here once: the host tier (``host_tier``: rows
fetched from the node's copy and updated on the host) or, with ``host_tables.resident_rows``, the device tier
(``device_tier``: a working set of rows with their state on the device), and the training pipeline (``pipeline``),
the step's end for the tables' optimizer member (``training/table_optimizer.py``).

The rest of the code uses these verbs only: ``stream`` (the schedule's data iterator with rows: ``pipeline``),
``rows`` (the forward's row leaf, through ``HostRowSource``), ``settle``, ``refresh``, ``table``, ``owner_table``,
``owner_tables``, ``load_tables``, ``sharded_state_dict`` and ``restore`` (checkpoints, export, ``stem-edit``),
``take_stats``; ``row_source`` for the model's STEM layers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from stem_megatron.config import HostTablesConfig
from stem_megatron.host_tables.adam_thread import RowUpdates
from stem_megatron.host_tables.device_tier import DeviceTier, OwnerTier
from stem_megatron.host_tables.exchange import DTYPES, RowExchange
from stem_megatron.host_tables.host_tier import HostTier, make_current, settle_node
from stem_megatron.host_tables.hot_rows import HotRowCache
from stem_megatron.host_tables.node import host_threads, node_layout
from stem_megatron.host_tables.ownership import RowOwnership
from stem_megatron.host_tables.pipeline import PlannedPipeline, PreloadPipeline, RowPipeline
from stem_megatron.host_tables.row_gradients import RowGradients
from stem_megatron.host_tables.row_optimizer import RowAdam, RowOptimizer
from stem_megatron.host_tables.row_state import HostRecord
from stem_megatron.host_tables.tier import Tier
from stem_megatron.host_tables.transfer import (HostToDevice, PrefetchedRows, cache_staging_bytes, landing_rows,
                                                staging_bytes, travel_dtype)
from stem_megatron.model.stem_rows import RowOrder
from stem_megatron.model.token_context import MicroBatchTokens
from stem_megatron.table_state import StateSpec

CHECKPOINT_KINDS = ("weight", "exp_avg", "exp_avg_sq")  # a checkpoint's: the master rows and both moments


@dataclass(frozen=True)
class StoreConfig:
    """What a store is built from: this stage's STEM ``layers`` (global, 1-based), each a ``vocab_size`` x ``d_ff`` table
    drawn with ``init_std`` from ``seed``; where the rows live and how they train (``host``: the run's ``host_tables``
    group); the rows' AdamW (``betas``, ``eps``, ``weight_decay``); the dtype the model computes in, and a step's
    shape on each DP rank (``micro_batch_tokens``: b * s; ``micro_batches``), which size the pinned staging and landing
    buffers on GPU before the first step (0 tokens: sized by the first steps)."""

    layers: tuple[int, ...]
    vocab_size: int
    d_ff: int
    init_std: float
    seed: int = 0
    host: HostTablesConfig = field(default_factory=HostTablesConfig)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    compute_dtype: Optional[torch.dtype] = None
    micro_batch_tokens: int = 0
    micro_batches: int = 1


class HostTableStore:
    """This rank's host tables. Verbs: the module's. Public attributes, read-only: ``layers``, ``vocab_size``,
    ``d_ff``, ``cols``, ``tp_rank``, ``read_dtype``, ``device``, ``host_bytes``; ``own`` (which rows this rank and
    node own, and where a node keeps them); ``record`` (the node's host record: each layer's table copy and state, read
    whole after ``settle``); ``pipeline`` (the training pipeline, handed to the tables' optimizer member, which ends
    each step through it and reads its step count); ``tier`` and ``optimizer`` (where rows are read and updated, and
    the rows' AdamW). The other parts are private."""

    hosted = True  # a checkpoint has a ``stem/`` part (``checkpoint/host_tables.py``; ``placement.NoTables``: none)

    def __init__(self, config: StoreConfig, device: Optional[torch.device] = None, copies=None):
        """Collective over the world (node and exchange groups and the shared tables are created here). The device
        tier where ``config.host.resident_rows`` (the working set's slots a layer), else the host tier. ``copies``: the
        copy engine of fetched rows (``transfer.HostToDevice``; default: CUDA's on GPU, none on CPU; a test's
        stand-in)."""
        h, vocab_size, d_ff = config.host, config.vocab_size, config.d_ff
        optimizer, resident_rows, micro_batch_tokens = h.optimizer, h.resident_rows, config.micro_batch_tokens
        if optimizer not in ("lazy", "dense"):
            raise ValueError(f"host_tables.optimizer must be 'lazy' or 'dense', got {optimizer!r}")
        self.layers = list(config.layers)  # global 1-based layer numbers of this stage's STEM layers
        self.vocab_size, self.d_ff = vocab_size, d_ff
        self.device = device or torch.device("cpu")
        dp_group = parallel_state.get_data_parallel_group()
        dp = dist.get_world_size(dp_group)
        node = node_layout(dist.get_process_group_ranks(dp_group), planning=bool(resident_rows))  # (``plan_ahead``)
        self.own = RowOwnership(vocab_size, node.dp_nodes, node.dp_node, len(node.local_dp_peers), node.peer_index)
        self._exchange = RowExchange(self.own, node, self.device, h.wire_dtype)
        self.record = HostRecord(self.layers, vocab_size, d_ff, config.init_std, config.seed, node, self.own,
                                 DTYPES[h.read_dtype], h.shm_dir, h.host_memory_gib, StateSpec.of(h))
        self.tp_rank, self.cols, self.read_dtype = self.record.tp_rank, self.record.cols, self.record.read_dtype
        self._counters = _new_counters()  # this step's, added to by the tier and the pipeline
        self._updates = RowUpdates(h.overlap_update, host_threads(self.device), self.device)
        travel = travel_dtype(self.read_dtype, config.compute_dtype)
        step_ids = dp * min(vocab_size, config.micro_batches * micro_batch_tokens)
        rows = min(vocab_size, micro_batch_tokens)  # distinct ids of a micro-batch, at most
        cache = HotRowCache(h.cache_rows, vocab_size, self.device)  # none (0 rows) beside a working set
        slot_bytes = max(staging_bytes(len(self.layers), rows, self.cols, travel.itemsize, micro_batch_tokens)
                         if rows else 0, cache_staging_bytes(cache.capacity, self.cols, travel.itemsize))
        self._h2d = HostToDevice(self.device, dtype=config.compute_dtype, slot_bytes=slot_bytes, copies=copies)
        # the host's rows (a working set: a twin of its own); the lean update rounds by a row's token id and column
        own = self.own
        self.optimizer = RowOptimizer(RowAdam(config.betas, config.eps, config.weight_decay), "rows", self.device,
                                      dense=optimizer == "dense", spec=self.record.spec, seed=config.seed,
                                      col0=self.tp_rank * self.cols, token_ids=lambda rows: own.ids_at(own.lo + rows))
        parts = (self.record, self._exchange, self.optimizer, self._updates, self._counters, self._h2d, cache)
        self.tier: Tier  # with its training pipeline's kind: the one place that asks where rows are updated
        if resident_rows:
            moving = min(resident_rows, landing_rows(self.own, step_ids))  # rows entering the working set at once
            tier, pipeline = (OwnerTier, PlannedPipeline) if dp > 1 else (DeviceTier, PreloadPipeline)
            self.tier = tier(*parts, resident_rows, travel, moving, micro_batch_tokens)
        else:
            self.tier, pipeline = HostTier(*parts, landing_rows(self.own, step_ids)), RowPipeline
        self._grads = RowGradients(self.layers, self.cols, self._exchange, dp_group, self.device, h.overlap_exchange,
                                  self.tier.land)
        # the training stream, each step's end and count; over the store's parts, not the store: a store the pipeline
        # pointed back to would outlive its last reference until the garbage collector ran, and with it the node's tables
        self.pipeline = pipeline(self.tier, self._grads, self._updates, self._counters, self.tier.admit, self.device,
                                 self.vocab_size)

    def row_source(self) -> ModuleSpec:
        """The STEM layers' row source, reading this store (``HostRowSource``)."""
        return ModuleSpec(module=HostRowSource, params={"store": self})

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory this rank's node holds for this stage's tables and moments."""
        return self.record.host_bytes

    # ---- a training run's side ----
    def stream(self, batches: Iterator[dict], micro_batches: int, depth: int = 2, training: bool = True
               ) -> RowPipeline:
        """``batches`` with their rows attached, ``micro_batches`` a step (``pipeline.RowPipeline``: a context
        manager, the schedule's data iterator and, in training, ``pipeline``, the step's end, ``RowPipeline.step``;
        validation: a pipeline of its own, reading the node's copy)."""
        if training:
            return self.pipeline.open(batches, micro_batches, depth)
        admit = functools.partial(make_current, self.tier)
        validation = RowPipeline(self.tier, self._grads, self._updates, self._counters, admit, self.device,
                                 self.vocab_size, training=False)
        return validation.open(batches, micro_batches, depth)

    def rows(self, layer: int, prefetched: PrefetchedRows) -> torch.Tensor:
        """(forward) A micro-batch's rows of ``layer`` (its distinct ids x this rank's columns, fp32); with gradients
        enabled a leaf whose gradient backward fills and the pipeline takes to the rows' owners."""
        rows = self.tier.read(layer, prefetched)
        if torch.is_grad_enabled():
            rows = rows.detach().requires_grad_()
            self._grads.track(layer, prefetched.in_step, rows)
        return rows

    # ---- the tables whole ----
    def settle(self) -> None:
        """Wait for the last step's CPU Adam here and on this rank's DP peers on the node (their rows share its copy of
        this TP block), the device tier's rows written back first: call before reading tables or moments whole.
        Collective over those peers (``node.local``), not the node: other TP ranks and stages need not call it."""
        settle_node(self.tier)

    def refresh(self, ids: torch.Tensor) -> None:
        """Make this node's copy of rows ``ids`` equal the owners' rows. Collective over the world's ranks of this
        stage's DP group and the node."""
        make_current(self.tier, ids)

    def table(self, layer: int) -> torch.Tensor:
        """``U_l`` as a V x d_ff fp32 matrix from this node's copy, by token id; current where ``refresh`` made it so.
        Collective over the TP group: every TP rank's block is settled before any is read."""
        self.settle()
        if self.record.tp > 1:
            dist.barrier(parallel_state.get_tensor_model_parallel_group())
        return self.record.table(layer)

    def owner_table(self, layer: int) -> Optional[torch.Tensor]:
        """``U_l`` as a V x d_ff fp32 matrix of the owners' master rows, on DP rank 0 (None elsewhere); a collective
        over the first peers of this DP group's nodes (every TP rank settles its block first: ``export.writer``)."""
        self.settle()
        return self.record.owner_table(layer)

    def owner_tables(self) -> dict[int, torch.Tensor]:
        """``owner_table`` of every layer, on TP rank 0 (the rows of DP rank 0; empty elsewhere)."""
        if self.tp_rank != 0:
            return {}
        tables = {layer: self.owner_table(layer) for layer in self.layers}
        return {layer: table for layer, table in tables.items() if table is not None}

    def load_tables(self, tables: dict[int, torch.Tensor]) -> None:
        """Overwrite this rank's column block of each ``U_l`` from V x d_ff matrices by token id (node collective)."""
        self.settle()
        self.record.load(tables)
        self.tier.drop()

    def sharded_state_dict(self, kinds: tuple[str, ...] = CHECKPOINT_KINDS, loading: bool = False) -> dict:
        """``{key: megatron ShardedTensor}`` of this node's rows of each kind, in the ownership permutation's order
        (row p holds token id ``ids_at(p)``; the masters for ``weight``), in the row state's dtypes and shapes
        (``HostRecord.checkpointed``): each node its range, each TP rank its column block. Loading: on the node's
        first DP peer only (the peers share the node's memory), straight into the node's copy with fp32 copies; then
        ``restore``."""
        record = self.record
        if loading and record.node.peer_index != 0:
            return {}
        out = {}
        for layer in self.layers:
            for kind in kinds:
                block, offset, shape = record.checkpointed(kind, layer, loading)
                out[f"L{layer}.{kind}"] = ShardedTensor(
                    f"stem.L{layer}.{kind}.by_owner", block, block.dtype, tuple(block.shape), shape, offset,
                    axis_fragmentations=None, replica_id=record.node.peer_index)  # uneven ranges: DCP reshards
        return out

    def restore(self, steps_done: Optional[int] = None) -> None:
        """After a checkpoint's rows were loaded into ``sharded_state_dict(loading=True)``'s tensors: every node's copy
        from the owners' rows (``HostRecord.copies_from_masters``), and to resume, the Adam step count
        ``steps_done`` (None: a new run from the checkpoint's tables). Collective over the world."""
        dist.barrier(self.record.node.group)
        self.tier.drop()
        if self.record.copies_from_masters():
            self.refresh(torch.arange(self.vocab_size))
        if steps_done is not None:
            self.settle()
            self.pipeline.resume(steps_done)
            self.record.current.fill_(True)
            self.tier.drop(steps_done)

    # ---- metrics ----
    def take_stats(self, stream: Optional[RowPipeline] = None) -> dict:
        """This step's counters (prefixed ``stem_``), reset for the next step: ``stem_bytes_sent`` by this rank to its
        DP peers anywhere; ``stem_node_*`` for this rank's node in total (bytes sent to and received from other nodes,
        table rows Adam updated, each layer counted), a collective over the node; with ``stream``, the training
        thread's wait for its rows (``stem_prefetch_wait_s``)."""
        stats = dict(self._counters)
        self._counters.update(_new_counters())
        for part in (self._grads, self._updates, *self.tier.parts):
            stats.update(part.take_stats())
        wire = self._exchange.take_stats()
        node = torch.tensor([wire["inter_node_sent"], wire["inter_node_received"],
                             stats.pop("rows_updated") / self.record.tp], dtype=torch.float64)
        dist.all_reduce(node, group=self.record.node.group)
        hits, lookups = stats.pop("cache_hits"), stats.pop("cache_lookups")
        out = {f"stem_{k}": v for k, v in stats.items()}
        out.update(stem_bytes_sent=wire["bytes_sent"], stem_node_bytes_sent=int(node[0]),
                   stem_node_bytes_received=int(node[1]), stem_node_rows_updated=round(float(node[2])),
                   stem_exchange_s=wire["exchange_s"])
        out["stem_cache_hit_rate"] = hits / lookups if lookups else None
        out["stem_host_table_bytes"] = self.host_bytes
        if stream is not None:
            out["stem_prefetch_wait_s"] = stream.take_wait_s()
        return out


def _new_counters() -> dict:
    """A step's fetch counters (the prefetch thread's, counted as the schedule takes each micro-batch), row gradient
    bytes landed on the host, and rows updated, later, and pulled across nodes."""
    return dict(unique_tokens=0, rows_fetched=0, bytes_to_device=0, bytes_from_device=0, rows_updated=0,
                rows_updated_later=0, rows_pulled=0, cache_hits=0, cache_lookups=0)


class HostRowSource(MegatronModule):
    """The row source of a STEM layer whose ``U_l`` lives in host memory (the layer spec's ``row_source``).

    It holds no parameters. It takes the rows fetched for this micro-batch (unique ids x this TP rank's columns) from
    its store (``HostTableStore.rows``, or inference's read-only tables). ``compact`` hands the STEM layer those rows
    with each token's position among them and the order the prefetch sorted the tokens in, for
    ``model.stem_rows.silu_times_rows``; ``forward`` expands the rows to tokens (the variants that add to or gate with
    the rows). Either way backward adds into the compact leaf (in fp32), so only touched rows carry a gradient."""

    def __init__(self, config: TransformerConfig, vocab_size: int, store):
        super().__init__(config=config)
        if vocab_size != store.vocab_size:
            raise ValueError(f"STEM layer vocab_size {vocab_size} != host store vocab_size {store.vocab_size}")
        self.store = store
        self.layer_number: int | None = None

    def set_layer_number(self, layer_number: int) -> None:
        if layer_number not in self.store.layers:
            raise ValueError(f"layer {layer_number} has no table in the host store (has {self.store.layers})")
        self.layer_number = layer_number

    def compact(self, tokens: MicroBatchTokens) -> tuple[torch.Tensor, torch.Tensor, Optional[RowOrder]]:
        """(the rows fetched for ``tokens``, ``[u, d_ff/tp]`` fp32; each token's row, ``[s, b]``; the tokens' order by
        row, or None where the fetch computed none)."""
        prefetched, rows = self._rows(tokens)
        return rows, prefetched.inverse.t(), prefetched.order

    def forward(self, tokens: MicroBatchTokens) -> torch.Tensor:
        """The rows fetched for ``tokens`` as [s, b, d_ff/tp]."""
        prefetched, rows = self._rows(tokens)
        # Gather in fp32, then cast to the model's dtype (bf16 on GPU): the backward of the gather adds the gradients
        # of a token's repeats in fp32 into the fp32 compact leaf (gathering bf16 rows would add them in bf16)
        return F.embedding(prefetched.inverse.t(), rows).to(self.config.params_dtype)

    def _rows(self, tokens: MicroBatchTokens) -> tuple[PrefetchedRows, torch.Tensor]:
        prefetched = tokens.rows
        if prefetched is None:
            raise RuntimeError("a host-resident STEM layer ran without fetched rows: read the batches through "
                               "HostTableStore.stream (training) or pass the rows of the read-only tables' fetch to "
                               "token_ids (inference)")
        prefetched.wait()
        return prefetched, self.store.rows(self.layer_number, prefetched)
