"""The STEM tables' bytes under each table-state setting (``host_tables.state_dtype``, ``second_moment``,
``master_dtype``; docs/lean_tables.md), for the memory plan: ``StateSpec``'s stored and moved bytes per parameter,
plus the node's read copy where it is not the master (bf16 copies of fp32 masters: stored, and written by each
update), and a row's bytes of each kind as the host record lays them out."""

from __future__ import annotations

from stem_megatron.config import HostTablesConfig
from stem_megatron.table_state import DTYPES, KINDS, StateSpec

# every setting, the paper's fp32 AdamW first and the leanest last
SETTINGS = tuple(StateSpec(state, moment, master) for master in DTYPES for state in DTYPES
                 for moment in ("element", "row"))


def read_dtype(h: HostTablesConfig, spec: StateSpec) -> str:
    """The dtype of a node's copy of every row: a bf16 master is the copy; else ``host_tables.read_dtype``."""
    return "bf16" if spec.master_dtype == "bf16" else h.read_dtype


def separate_master(spec: StateSpec, read: str) -> bool:
    """Whether the owned rows' masters are files of their own beside the read copy (fp32 masters of bf16 copies)."""
    return read != spec.master_dtype


def row_bytes(spec: StateSpec, read: str, d_ff: int, tp: int) -> dict[str, int]:
    """A row's bytes in a TP rank's block (``[tp, rows, spec.cols]`` files): its ``copy`` and each kind of its
    state, a ``master`` only where it is not the copy."""
    cols, blocks = d_ff // tp, StateSpec.blocks(d_ff, tp)
    kinds = {kind: spec.dtype(kind).itemsize * spec.cols(kind, cols, blocks) for kind in KINDS}
    return {"copy": DTYPES[read].itemsize * cols} | kinds | {"master": kinds["master"] * separate_master(spec, read)}


def per_parameter(spec: StateSpec, read: str, d_ff: int, tp: int) -> dict[str, float]:
    """Bytes per table parameter: ``host``, one node's (every row owned); ``touched`` and ``untouched``, the memory
    traffic of an update of a row with and without a gradient (dense Adam's untouched rows)."""
    copy = DTYPES[read].itemsize if separate_master(spec, read) else 0
    # a row of ``blocks`` second moments holds per parameter what a row of cols / blocks columns with one does
    cols = d_ff // tp // StateSpec.blocks(d_ff, tp)
    return {"host": spec.stored_bytes(cols) + copy, "touched": spec.moved_bytes(cols) + copy,
            "untouched": spec.moved_bytes(cols, gradient=False) + copy}


def setting_name(spec: StateSpec) -> str:
    """``fp32``, ``lean`` (all three lean), or the fields that differ from fp32's."""
    if spec == SETTINGS[0]:
        return "fp32"
    if spec == SETTINGS[-1]:
        return "lean"
    return ", ".join(f"{k}={v}" for k, v in vars(spec).items() if v != getattr(SETTINGS[0], k))


def print_settings(rows: list[dict], run: str, read: str, unit: tuple[int, str]) -> None:
    """One table: each setting's host bytes per parameter, the traffic per parameter an update moves and the
    neediest node's table files; ``run`` marks the run's setting, ``read`` the copies of fp32 masters."""
    size, name = unit
    print(f"\n{'table state (host_tables.)':<44}{'B/param':>8}{'moved: touched':>16}{'untouched':>11}"
          f"{'node':>14}")
    for row in rows:
        setting = row["setting"] + (" (this run)" if row["setting"] == run else "")
        print(f"  {setting:<42}{row['host']:>8.3f}{row['touched']:>16.3f}{row['untouched']:>11.3f}"
              f"{row['node_bytes'] / size:>10.2f} {name}")
    print(f"  B/param: a table parameter's host bytes, with {read} copies of fp32 masters\n"
          f"  moved: the memory traffic of its update, its row with / without a gradient")
