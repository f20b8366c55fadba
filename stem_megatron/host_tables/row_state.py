"""The state of STEM table rows in one layout, and this node's host record of it (docs/host_tables.md).

``RowState``: per STEM layer a row's ``master`` and both Adam moments, ``[rows, cols]`` tensors (fp32, or lean:
``table_state.StateSpec``), each kind a ``{layer: tensor}``. Every holder of rows uses it: the host record (the
owner's block), the device tier's slots (``working_set.WorkingSet``) and the rows staged ahead
(``staged_rows.StagedRows``), so the row optimizer takes one layout, whoever holds the rows (as FBGEMM's TBE keeps
weights and both momenta).

``HostRecord``: this node's tables of one pipeline stage, mapped from node-shared files (``node.shared_tensors``,
TP-major ``[tp, rows, cols]``, so a TP rank's column block is one contiguous ``[rows, cols]`` block): ``read``, the
copy fetches read (every row, in the ownership permutation's order, ``host_tables.read_dtype``), and ``state``, the row
state of the rows this node owns (``ownership.RowOwnership``) in the ``StateSpec``'s dtypes and shapes; the masters
are the owned range of the copy itself where their dtypes agree (fp32, or the lean bf16 masters), else (fp32
masters of bf16 copies) a block of their own. The other nodes' rows in ``read`` are current where
``current`` says so (``store.HostTableStore.refresh`` pulls them from their owners). The whole-table verbs read and
write it as V x d_ff matrices by token id (checkpoints, export, ``stem-edit``, tests).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from stem_megatron.host_tables.node import NodeLayout, shared_tensors
from stem_megatron.host_tables.ownership import RowOwnership
from stem_megatron.model.device_table import table_row_chunks
from stem_megatron.table_state import DTYPES, KINDS, StateSpec, converted  # noqa: F401 (DTYPES, StateSpec: their
# importers' name for them here)

@dataclass
class RowState:
    """Per STEM layer, ``[rows, cols]`` tensors of each kind of a row's state (``StateSpec``'s dtypes; a row-wise
    ``exp_avg_sq`` is ``[rows, 1]``)."""

    master: dict[int, torch.Tensor]
    exp_avg: dict[int, torch.Tensor]
    exp_avg_sq: dict[int, torch.Tensor]

    @classmethod
    def zeros(cls, layers: list[int], rows: int, cols: int, device: torch.device,
              spec: StateSpec = StateSpec(), blocks: int = 1) -> RowState:
        """Zero rows; a row-wise second moment of ``blocks`` values a row (``StateSpec.blocks``)."""
        return cls(*({layer: torch.zeros(rows, spec.cols(kind, cols, blocks), dtype=spec.dtype(kind), device=device)
                      for layer in layers} for kind in KINDS))

    def kind(self, name: str) -> dict[int, torch.Tensor]:
        return getattr(self, name)

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        """``layer``'s rows of each kind."""
        return {kind: self.kind(kind)[layer] for kind in KINDS}

    def of(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``layer``'s (master, exp_avg, exp_avg_sq), the row optimizer's arguments."""
        return self.master[layer], self.exp_avg[layer], self.exp_avg_sq[layer]


class HostRecord:
    """This node's copy of every row and its owned rows' state, for ``layers`` (this stage's STEM layers)."""

    def __init__(self, layers: list[int], vocab_size: int, d_ff: int, init_std: float, seed: int, node: NodeLayout,
                 own: RowOwnership, read_dtype: torch.dtype, shm_dir: str, host_memory_gib: Optional[float],
                 spec: StateSpec = StateSpec()):
        """Collective over the world (the run's file names, then the node's shared files)."""
        self.layers, self.vocab_size, self.d_ff = list(layers), vocab_size, d_ff
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.cols = d_ff // self.tp
        self.node, self.own, self.read_dtype, self.spec = node, own, read_dtype, spec
        if spec.dtype("master") != torch.float32 and read_dtype != spec.dtype("master"):
            raise ValueError("host_tables.master_dtype=bf16: the masters are the node's bf16 copy of the table: set "
                             "host_tables.read_dtype=bf16 too, or master_dtype=fp32")
        self.blocks = spec.blocks(d_ff, self.tp)  # a row-wise second moment's values a row of this block
        run_id = [secrets.token_hex(6) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(run_id, src=0)
        owned = own.owned_rows
        specs = {"copy": (vocab_size, self.cols, read_dtype)}
        specs.update({kind: (owned, spec.cols(kind, self.cols, self.blocks), spec.dtype(kind)) for kind in KINDS
                      if kind != "master" or spec.dtype(kind) != read_dtype})
        names = {(layer, kind): f"stem-{run_id[0]}-n{node.node}-L{layer}-{kind}"
                 for layer in self.layers for kind in specs}
        by_name = {name: key for key, name in names.items()}

        def init(name: str, tensor: torch.Tensor) -> None:
            layer, kind = by_name[name]
            if kind in ("copy", "master"):
                self._init_table(tensor, layer, seed, init_std, owned=kind == "master")
            # moments: tmpfs pages start at zero

        shared = shared_tensors({name: ((self.tp, *specs[kind][:2]), specs[kind][2])
                                 for (_, kind), name in names.items()}, node.group, init, directory=shm_dir,
                                host_memory_gib=host_memory_gib)
        self.full = {key: shared[name] for key, name in names.items()}  # [tp, rows, cols], node-shared
        self.read = {layer: self.full[layer, "copy"][self.tp_rank] for layer in self.layers}  # position order
        masters = {layer: self.full[layer, "master"][self.tp_rank] if "master" in specs
                   else self.read[layer][own.lo:own.hi] for layer in self.layers}
        self.state = RowState(masters, *({layer: self.full[layer, kind][self.tp_rank] for layer in self.layers}
                                         for kind in KINDS[1:]))
        # rows of my class in my node's copy that equal their owner's (rows my node owns always do)
        self.current = torch.ones(vocab_size, dtype=torch.bool)
        self.saved: Optional[StateSpec] = None  # the spec of the checkpoint being loaded (``expect``)
        self._loaded: dict = {}  # (kind, layer) -> its rows in the saved spec, for ``take_loaded``

    @property
    def separate_master(self) -> bool:
        """The masters are a block of their own (fp32 masters of bf16 copies), not the owned range of the copy."""
        return self.spec.dtype("master") != self.read_dtype

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory this rank's node holds for this stage's tables and moments."""
        return sum(t.numel() * t.element_size() for t in self.full.values())

    def local(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's row in ``state`` (ids this node owns)."""
        return self.own.local(ids)

    def write(self, layer: int, kind: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows ``ids``' state ``kind`` of ``layer`` (a working set's, written back); masters into ``read`` too."""
        self.state.kind(kind)[layer][self.own.local(ids)] = rows
        if kind == "master":
            self.read[layer][self.own.position(ids)] = rows.to(self.read_dtype)

    def round_copies(self, layer: int, rows: torch.Tensor) -> None:
        """The node's copy of its own ``rows`` (of ``state``) after an update: fp32 masters rounded (bf16 copies;
        where the copy is the master there is nothing to round)."""
        if self.separate_master:
            self.read[layer][self.own.lo + rows] = self.state.master[layer][rows].to(self.read_dtype)

    def pull(self, ids: torch.Tensor, exchange) -> int:
        """Make this node's copy of rows ``ids`` (any DP peer on the node may ask for its own) equal the owners'
        rows (``RowExchange.pull``); returns the rows pulled. Collective over this stage's DP group and the node: every
        peer's rows are in the node's copy before anyone reads (the caller has settled the updates first)."""
        pulled = 0
        if self.layers:
            need = exchange.node_needs(ids)
            stale = need[~self.current[need] & (self.own.owner(need) != self.own.node)]
            exchange.pull(stale, [self.read[layer] for layer in self.layers])
            self.current[stale] = True
            pulled = stale.numel()
        dist.barrier(self.node.group)
        return pulled

    def _init_table(self, full: torch.Tensor, layer: int, seed: int, std: float, owned: bool) -> None:
        """``table_row_chunks``' rows (the device table's): the whole copy, or (``owned``) the master rows of this
        node's block."""
        for start, rows in table_row_chunks(seed, layer, self.vocab_size, self.d_ff, std):
            ids = torch.arange(start, start + rows.shape[0])
            at = self.own.position(ids)
            if owned:
                mine = self.own.owner(ids) == self.own.node
                rows, at = rows[mine], at[mine] - self.own.lo
            full[:, at] = rows.view(rows.shape[0], self.tp, self.cols).transpose(0, 1).to(full.dtype)

    # ---- whole tables (the caller settles first: ``HostTableStore.settle``) ----
    def table(self, layer: int) -> torch.Tensor:
        """``U_l`` as a V x d_ff fp32 matrix from this node's copy (every TP block is in the node's shared file),
        by token id; current where ``current`` says so."""
        full = self.full[layer, "copy"][:, self.own.position(torch.arange(self.vocab_size))]
        return full.transpose(0, 1).reshape(self.vocab_size, self.d_ff).float()

    def owner_table(self, layer: int) -> Optional[torch.Tensor]:
        """``U_l`` as a V x d_ff fp32 matrix of the owners' master rows (bf16 ones widened), on DP rank 0 (None
        elsewhere); a collective over the first peers of this DP group's nodes."""
        if self.node.peer_index != 0:
            return None
        block = self.full[layer, "master"] if (layer, "master") in self.full else \
            self.full[layer, "copy"][:, self.own.lo:self.own.hi]
        blocks = [block]
        if self.node.rail is not None:
            blocks = [None] * self.node.dp_nodes if self.node.dp_node == 0 else None
            dist.gather_object(block.clone(), blocks, dst=dist.get_process_group_ranks(self.node.rail)[0],
                               group=self.node.rail)
        if self.node.dp_node != 0:
            return None
        by_position = torch.cat(blocks, dim=1)  # [tp, V, cols]: the nodes' ranges in order
        full = by_position[:, self.own.position(torch.arange(self.vocab_size))]
        return full.transpose(0, 1).reshape(self.vocab_size, self.d_ff).to(torch.float32, copy=True)

    def load(self, tables: dict[int, torch.Tensor]) -> None:
        """This rank's column block of each ``U_l`` from V x d_ff matrices by token id (node collective)."""
        every = torch.arange(self.vocab_size)
        for layer, table in tables.items():
            block = table[:, self.tp_rank * self.cols:(self.tp_rank + 1) * self.cols]
            self.read[layer][self.own.position(every)] = block.to(self.read_dtype)
            self.state.master[layer].copy_(block[self.own.ids_at(torch.arange(self.own.lo, self.own.hi))])
        self.current.fill_(True)
        dist.barrier(self.node.group)

    def copies_from_masters(self) -> bool:
        """After the master rows were loaded: the node's copy of its own rows from them (bf16 copies of fp32
        masters: a checkpoint holds the masters only). Returns whether the other nodes' rows are stale now (all but
        a whole fp32 copy loaded as it was saved)."""
        saved, self.saved = self.saved or self.spec, None
        if self.read_dtype == torch.float32 and saved.dtype("master") == torch.float32:
            return False
        for layer in self.layers if self.separate_master else ():
            self.read[layer][self.own.lo:self.own.hi] = self.state.master[layer].to(self.read_dtype)
        self.current.fill_(False)
        return True

    # ---- checkpoints (``checkpoint/host_tables.py``) ----
    def expect(self, saved: StateSpec) -> None:
        """A checkpoint of ``saved``'s state is loaded next (every rank): kinds stored otherwise than this run's load
        into tensors of the checkpoint's (``checkpointed``) and convert once (``take_loaded``)."""
        self.saved = saved

    def checkpointed(self, kind: str, layer: int, loading: bool
                     ) -> tuple[torch.Tensor, tuple[int, int], tuple[int, int]]:
        """(the tensor a checkpoint's ``kind`` of ``layer`` maps to, its offset and the global shape: V x the
        kind's columns): this node's range (the masters for ``weight``) of this TP rank's block, or for loading
        into fp32 copies the whole copy (its master range included); loading a checkpoint stored otherwise
        (``expect``), a tensor of its dtype and shape, which ``take_loaded`` converts."""
        name, spec = "master" if kind == "weight" else kind, (self.saved if loading and self.saved else self.spec)
        width, mine = spec.cols(name, self.cols, spec.blocks(self.d_ff, self.tp)), self.state.kind(name)[layer]
        at, shape = (self.own.lo, self.tp_rank * width), (self.vocab_size, width * self.tp)
        if (width, spec.dtype(name)) != (mine.shape[1], mine.dtype):
            self._loaded[name, layer] = torch.empty(mine.shape[0], width, dtype=spec.dtype(name))
            return self._loaded[name, layer], at, shape
        if kind == "weight" and loading and self.read_dtype == torch.float32:
            return self.read[layer], (0, at[1]), shape
        return mine, at, shape

    def take_loaded(self) -> None:
        """The kinds ``checkpointed`` loaded in the checkpoint's spec, converted into this run's (docs/checkpoints.md):
        bf16 widened or fp32 rounded to nearest even; an element-wise second moment's mean over each block of a
        row-wise one, a row-wise one spread over its block's columns."""
        for (kind, layer), values in self._loaded.items():
            mine = self.state.kind(kind)[layer]
            mine.copy_(converted(values, mine.shape[1]))
        self._loaded.clear()
