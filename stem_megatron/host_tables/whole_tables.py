"""``U_l`` as whole V x d_ff matrices by token id, out of and into a ``store.HostTableStore`` (tests, checkpoints,
export, ``stem-edit``): the store's storage is node-shared, TP-blocked and in the ownership permutation's order."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from stem_megatron.model.device_table import table_row_chunks


class WholeTables:
    """The whole-matrix views of ``HostTableStore`` (its base class)."""

    def _init_table(self, full: torch.Tensor, layer: int, seed: int, std: float, owned: bool) -> None:
        """``table_row_chunks``' rows (the device table's): the whole copy, or (``owned``) the master rows of
        this node's block."""
        for start, rows in table_row_chunks(seed, layer, self.vocab_size, self.d_ff, std):
            ids = torch.arange(start, start + rows.shape[0])
            at = self.own.position(ids)
            if owned:
                mine = self.own.owner(ids) == self.own.node
                rows, at = rows[mine], at[mine] - self.own.lo
            full[:, at] = rows.view(rows.shape[0], self.tp, self.cols).transpose(0, 1).to(full.dtype)

    def table(self, layer: int) -> torch.Tensor:
        """``U_l`` as a V x d_ff fp32 matrix from this node's copy (all TP blocks are in the node's shared
        file), by token id; current where ``refresh`` made it so. Collective over the TP group: every TP rank's
        block is settled (a working set's rows written back) before any is read."""
        self.settle()
        if self.tp > 1:
            dist.barrier(parallel_state.get_tensor_model_parallel_group())
        full = self.full[layer, "weight"][:, self.own.position(torch.arange(self.vocab_size))]
        return full.transpose(0, 1).reshape(self.vocab_size, self.d_ff).float()

    def owner_table(self, layer: int) -> Optional[torch.Tensor]:
        """``U_l`` as a V x d_ff matrix of the owners' fp32 master rows, on DP rank 0 (None elsewhere); a
        collective over the first peers of this DP group's nodes (all TP blocks of a node's master rows are
        in its shared files: every TP rank settles them first, ``export.writer``)."""
        self.settle()
        if self.node.peer_index != 0:
            return None
        block = self.full[layer, "master"] if (layer, "master") in self.full else \
            self.full[layer, "weight"][:, self.own.lo:self.own.hi]
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

    def load_tables(self, tables: dict[int, torch.Tensor]) -> None:
        """Overwrite this rank's column block of each ``U_l`` from V x d_ff matrices by token id (node
        collective)."""
        self.settle()
        every = torch.arange(self.vocab_size)
        for layer, table in tables.items():
            block = table[:, self.tp_rank * self.cols:(self.tp_rank + 1) * self.cols]
            self.weight[layer][self.own.position(every)] = block.to(self.read_dtype)
            self.master[layer].copy_(block[self.own.ids_at(torch.arange(self.own.lo, self.own.hi))])
        self.current.fill_(True)
        self.drop_resident()
        dist.barrier(self.node.group)

    def copies_from_masters(self) -> None:
        """After the master rows were loaded (bf16 copies: the checkpoint holds fp32 masters only): every
        node's copy from the owners' rows. Collective over the world."""
        self.drop_resident()
        if self.read_dtype != torch.float32:
            for layer in self.layers:
                lo, hi = self.own.lo, self.own.hi
                self.weight[layer][lo:hi] = self.master[layer].to(self.read_dtype)
            self.current.fill_(False)
            self.refresh(torch.arange(self.vocab_size))
