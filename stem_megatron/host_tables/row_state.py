"""The state of STEM table rows in one layout, and this node's host record of it (docs/host_tables.md).

``RowState``: per STEM layer a row's ``master`` and both Adam moments, ``[rows, cols]`` tensors (fp32, or lean:
``StateSpec``), each kind a ``{layer: tensor}``. Every holder of rows uses it: the host record (the owner's block),
the device tier's slots (``working_set.WorkingSet``) and the rows staged ahead (``staged_rows.StagedRows``), so the
row optimizer takes one layout, whoever holds the rows (as FBGEMM's TBE keeps weights and both momenta).

``HostRecord``: this node's tables of one pipeline stage, mapped from node-shared files (``node.shared_tensors``,
TP-major ``[tp, rows, cols]``, so a TP rank's column block is one contiguous ``[rows, cols]`` block): ``read``, the
copy fetches read (every row, in the ownership permutation's order, ``host_tables.read_dtype``), and ``state``, the row
state of the rows this node owns (``ownership.RowOwnership``; with fp32 copies the masters are the owned range of
the copy itself, with bf16 copies a block of their own). The other nodes' rows in ``read`` are current where
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

KINDS = ("master", "exp_avg", "exp_avg_sq")  # a row's state: its master and both Adam moments
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class StateSpec:
    """How a row's state is stored (docs/lean_tables.md): ``state_dtype``, the moments' (``exp_avg``, and
    ``exp_avg_sq`` per element); ``second_moment``, ``element`` (one per parameter) or ``row`` (one fp32 per row);
    ``master_dtype``, ``bf16`` where the read copy is the master, stochastically rounded. All fp32 and ``element``:
    the paper's AdamW, DeepSpeed's kernel; anything else is lean (``lean_adam``)."""

    state_dtype: str = "fp32"
    second_moment: str = "element"
    master_dtype: str = "fp32"

    def __post_init__(self):
        for name, allowed in (("state_dtype", DTYPES), ("master_dtype", DTYPES), ("second_moment", ("element", "row"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"host_tables.{name} must be one of {', '.join(allowed)}, got "
                                 f"{getattr(self, name)!r}")

    @property
    def lean(self) -> bool:
        return self != StateSpec()

    def dtype(self, kind: str) -> torch.dtype:
        if kind == "master":
            return DTYPES[self.master_dtype]
        return torch.float32 if kind == "exp_avg_sq" and self.second_moment == "row" else DTYPES[self.state_dtype]

    def cols(self, kind: str, cols: int) -> int:
        """Columns of ``kind`` for rows of ``cols`` columns: a row-wise second moment has one."""
        return 1 if kind == "exp_avg_sq" and self.second_moment == "row" else cols

    def stored_bytes(self, cols: int) -> float:
        """Bytes of host memory per table parameter for the master and both moments (without a separate read copy)."""
        return sum(self.dtype(kind).itemsize * self.cols(kind, cols) for kind in KINDS) / cols

    def moved_bytes(self, cols: int, gradient: bool = True) -> float:
        """Bytes of memory traffic per parameter an update moves: each kind read and written, the fp32 gradient read
        (``gradient``; dense Adam's untouched rows have none)."""
        return 2 * self.stored_bytes(cols) + (4 if gradient else 0)


@dataclass
class RowState:
    """Per STEM layer, ``[rows, cols]`` tensors of each kind of a row's state (``StateSpec``'s dtypes; a row-wise
    ``exp_avg_sq`` is ``[rows, 1]``)."""

    master: dict[int, torch.Tensor]
    exp_avg: dict[int, torch.Tensor]
    exp_avg_sq: dict[int, torch.Tensor]

    @classmethod
    def zeros(cls, layers: list[int], rows: int, cols: int, device: torch.device,
              spec: StateSpec = StateSpec()) -> RowState:
        return cls(*({layer: torch.zeros(rows, spec.cols(kind, cols), dtype=spec.dtype(kind), device=device)
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
                 own: RowOwnership, read_dtype: torch.dtype, shm_dir: str, host_memory_gib: Optional[float]):
        """Collective over the world (the run's file names, then the node's shared files)."""
        self.layers, self.vocab_size, self.d_ff = list(layers), vocab_size, d_ff
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.cols = d_ff // self.tp
        self.node, self.own, self.read_dtype = node, own, read_dtype
        run_id = [secrets.token_hex(6) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(run_id, src=0)
        owned, fp32 = own.owned_rows, torch.float32
        specs = {"copy": (vocab_size, read_dtype), "exp_avg": (owned, fp32), "exp_avg_sq": (owned, fp32)}
        if read_dtype != fp32:
            specs["master"] = (owned, fp32)
        names = {(layer, kind): f"stem-{run_id[0]}-n{node.node}-L{layer}-{kind}"
                 for layer in self.layers for kind in specs}
        by_name = {name: key for key, name in names.items()}

        def init(name: str, tensor: torch.Tensor) -> None:
            layer, kind = by_name[name]
            if kind in ("copy", "master"):
                self._init_table(tensor, layer, seed, init_std, owned=kind == "master")
            # moments: tmpfs pages start at zero

        shared = shared_tensors({name: ((self.tp, specs[kind][0], self.cols), specs[kind][1])
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
        """The node's copy of its own ``rows`` (of ``state``) after an update: the masters rounded (bf16 copies)."""
        if self.read_dtype != torch.float32:
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
        """``U_l`` as a V x d_ff matrix of the owners' fp32 master rows, on DP rank 0 (None elsewhere); a collective
        over the first peers of this DP group's nodes."""
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
        return full.transpose(0, 1).reshape(self.vocab_size, self.d_ff).clone()

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
        """After the master rows were loaded: the node's copy of its own rows from them (bf16 copies: a checkpoint
        holds fp32 masters only). Returns whether the other nodes' rows are stale now."""
        if self.read_dtype == torch.float32:
            return False
        for layer in self.layers:
            self.read[layer][self.own.lo:self.own.hi] = self.state.master[layer].to(self.read_dtype)
        self.current.fill_(False)
        return True

    def sharded(self, kind: str, layer: int, loading: bool) -> tuple[torch.Tensor, int]:
        """(the tensor a checkpoint's ``kind`` of ``layer`` maps to, its first row among the V): this node's range
        (the masters for ``weight``), or for loading into fp32 copies the whole copy (its master range included)."""
        if kind == "weight" and loading and self.read_dtype == torch.float32:
            return self.read[layer], 0
        return self.state.kind("master" if kind == "weight" else kind)[layer], self.own.lo
