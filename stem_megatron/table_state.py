"""How a STEM table row's optimizer state is stored (docs/lean_tables.md): the one definition the config validates,
the host record, the device tier, checkpoints and the memory plan read. Below ``config.py`` (whose ``validate``
asks it), so it imports nothing of ours."""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("master", "exp_avg", "exp_avg_sq")  # a row's state: its master and both Adam moments
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROW_BLOCKS = 8  # a row-wise second moment: one value per d_ff / 8 global columns, so TP layouts up to 8 agree


@dataclass(frozen=True)
class StateSpec:
    """How a row's state is stored: ``state_dtype``, the moments' (``exp_avg``, and ``exp_avg_sq`` per element);
    ``second_moment``, ``element`` (one per parameter) or ``row`` (one fp32 per block of a row's columns);
    ``master_dtype``, ``bf16`` where the read copy is the master, stochastically rounded. All fp32 and ``element``:
    the paper's AdamW, DeepSpeed's kernel; anything else is lean (``lean_adam``)."""

    state_dtype: str = "fp32"
    second_moment: str = "element"
    master_dtype: str = "fp32"

    def __post_init__(self):
        problem = self.problem(self)
        if problem:
            raise ValueError(" ".join(problem))

    @staticmethod
    def problem(fields) -> tuple[str, str] | None:
        """(the field, what is wrong with it and the fix) of ``fields``' row state (a ``StateSpec`` or a
        ``HostTablesConfig``, whose bf16 masters are its read copy: they need ``read_dtype=bf16``), or None."""
        for name, allowed in (("state_dtype", DTYPES), ("second_moment", ("element", "row")), ("master_dtype", DTYPES)):
            if getattr(fields, name) not in allowed:
                return f"host_tables.{name}", f"must be one of {', '.join(allowed)}, got {getattr(fields, name)!r}"
        if fields.master_dtype == "bf16" and getattr(fields, "read_dtype", "bf16") != "bf16":
            return ("host_tables.master_dtype", "bf16: the masters are the node's bf16 copy of the table: set "
                    "host_tables.read_dtype=bf16 too, or master_dtype=fp32")
        return None

    @classmethod
    def of(cls, host_tables) -> StateSpec:
        """The spec of a ``HostTablesConfig`` (``config.validate`` has checked it)."""
        return cls(host_tables.state_dtype, host_tables.second_moment, host_tables.master_dtype)

    @property
    def lean(self) -> bool:
        return self != StateSpec()

    def dtype(self, kind: str) -> torch.dtype:
        if kind == "master":
            return DTYPES[self.master_dtype]
        return torch.float32 if kind == "exp_avg_sq" and self.second_moment == "row" else DTYPES[self.state_dtype]

    def cols(self, kind: str, cols: int, blocks: int = 1) -> int:
        """Columns of ``kind`` for rows of ``cols`` columns: a row-wise second moment has ``blocks``."""
        return blocks if kind == "exp_avg_sq" and self.second_moment == "row" else cols

    @staticmethod
    def blocks(d_ff: int, tp: int) -> int:
        """A row-wise second moment's values per row of a TP rank's block: ``ROW_BLOCKS`` over the whole row (one
        per ``d_ff / 8`` global columns) where ``tp`` and ``d_ff`` divide into them, else one per rank's block."""
        return ROW_BLOCKS // tp if ROW_BLOCKS % tp == 0 and d_ff % ROW_BLOCKS == 0 else 1

    def stored_bytes(self, cols: int) -> float:
        """Bytes of host memory per table parameter for the master and both moments (without a separate read copy)."""
        return sum(self.dtype(kind).itemsize * self.cols(kind, cols) for kind in KINDS) / cols

    def moved_bytes(self, cols: int, gradient: bool = True) -> float:
        """Bytes of memory traffic per parameter an update moves: each kind read and written, the fp32 gradient read
        (``gradient``; dense Adam's untouched rows have none)."""
        return 2 * self.stored_bytes(cols) + (4 if gradient else 0)


def converted(values: torch.Tensor, width: int) -> torch.Tensor:
    """A kind's rows (``[rows, c]``) as fp32 rows of ``width`` columns, the conversion of a checkpoint between specs:
    an element-wise second moment's mean over each of ``width`` blocks of columns (the row-wise value it stands
    for), a row-wise one spread over its block's columns; equal widths as they are."""
    values, have = values.float(), values.shape[1]
    if width < have:
        return values.view(values.shape[0], width, have // width).mean(2)
    return values.repeat_interleave(width // have, dim=1) if width > have else values
