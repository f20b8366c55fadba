"""Reversible knowledge edits on STEM tables: copy or swap rows ``e_src <- e_tgt`` (paper §5.2, Fig. 5).

Every STEM layer ``i`` (0-based, as in the export name ``decoder.layers.<i>.mlp.U_l.weight`` and in
``layer_plan``) has a V x d_ff table; token ``t``'s row is its FFN "address" in that layer. An edit
rewrites rows in place, leaving every other parameter and the prompt alone:

* ``copy``: each source id's row becomes (a weighted sum of) target rows, ``e_src <- e_tgt``;
* ``swap``: additionally the target ids get the source rows, ``e_tgt <- e_src`` (both read the rows as
  they were before the edit).

``StemEditor`` works on a ``{layer: V x d_ff tensor}`` dict of live tables: ``from_model`` takes them
from an ``InferenceModel``'s ``tables()`` (on-device parameters, or host-resident tables without the
hot-row cache, whose device copies an edit would leave stale). Each edit appends an ``EditRecord``
(layers, ids, previous and new rows); ``undo()`` writes the previous rows back, so a full undo
restores every row bitwise. The log saves as ``.pt`` or ``.json`` (rows base64-encoded raw
bytes, exact) and can be re-applied to a fresh copy of the model (``redo_log``).

A synthetic-facts experiment is then a few lines::

    editor = StemEditor.from_model(model)                     # model: InferenceModel
    for x, y in pairs:                                        # two subjects with different facts
        with editor.session():                                # undone on exit
            editor.edit_words(model.encode(" " + x), model.encode(" " + y), mode="swap")
            moved += top1(model, f"The capital of {x} is") == capital[y]
"""

from __future__ import annotations

import base64
import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence, Union

import torch

from stem_megatron.edit.row_plan import RowPlan, plan_rows

MODES = ("copy", "swap")
LOG_FORMAT = "stem-megatron-edit-log-v1"

Layers = Union[str, Sequence[int], None]


@dataclass
class EditRecord:
    """One edit: ``ids`` of every layer in ``layers`` went from ``before`` to ``after`` ([layers, k, d_ff])."""

    op: str
    layers: list[int]
    ids: list[int]
    before: torch.Tensor
    after: torch.Tensor
    meta: dict = field(default_factory=dict)

    def to_dict(self, binary: bool = False) -> dict:
        enc = (lambda t: t) if binary else _encode
        return {"op": self.op, "layers": self.layers, "ids": self.ids, "meta": self.meta,
                "before": enc(self.before), "after": enc(self.after)}

    @classmethod
    def from_dict(cls, d: dict) -> "EditRecord":
        dec = (lambda t: t) if isinstance(d["before"], torch.Tensor) else _decode
        return cls(d["op"], list(d["layers"]), list(d["ids"]), dec(d["before"]), dec(d["after"]), d.get("meta", {}))


class StemEditor:
    """Row edits on a model's STEM tables with an undo log (module doc)."""

    def __init__(self, tables: Mapping[int, torch.Tensor]):
        if not tables:
            raise ValueError("no STEM tables (decoder.layers.<i>.mlp.U_l.weight): knowledge edits need a STEM "
                             "model (variant stem, stem_dagger or stem_gate)")
        shapes = {tuple(t.shape) for t in tables.values()}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise ValueError(f"STEM tables must all be V x d_ff, got shapes {sorted(shapes)}")
        self.tables = dict(sorted(tables.items()))
        self.vocab_size, self.d_ff = next(iter(shapes))
        self.log: list[EditRecord] = []

    @classmethod
    def from_model(cls, model) -> "StemEditor":
        """On the live tables of an ``InferenceModel`` (``model.tables()``)."""
        if model.cache_rows:
            raise ValueError(f"{model.export_dir} is loaded with a hot-row cache of {model.cache_rows} rows whose "
                             "device copies an edit would not update: load it with cache_rows=0 to edit it")
        return cls(model.tables())

    @property
    def layers(self) -> list[int]:
        return list(self.tables)

    def resolve_layers(self, layers: Layers = None) -> list[int]:
        """``None``/``"all"``: every STEM layer; else a list or ``"1,3"`` of 0-based STEM layer indices."""
        if layers is None or layers == "all":
            return self.layers
        if isinstance(layers, str):
            layers = [int(x) for x in layers.split(",") if x.strip()]
        chosen = sorted({int(x) for x in layers})
        bad = [x for x in chosen if x not in self.tables]
        if bad or not chosen:
            raise ValueError(f"layers {bad or chosen} are not STEM layers; the STEM layers are {self.layers} "
                             "(0-based, as in decoder.layers.<i>)")
        return chosen

    # ------------------------------------------------------------------------------------ edits
    @torch.no_grad()
    def apply_plan(self, plan: RowPlan, mode: str = "copy", layers: Layers = None, meta: Optional[dict] = None
                   ) -> EditRecord:
        """Write ``plan`` (destination rows as mixes of rows) at ``layers``; ``swap`` also writes the reverse.

        The reverse of ``e_src[i] <- sum_j w_ij e_tgt[j]`` gives each target id the row of the source
        id holding its largest weight (for equal lengths: the exact swap ``e_tgt[i] <- e_src[i]``);
        the filler token and dropped target ids keep their rows.
        All new rows are computed from the tables before the edit, then written at once.
        """
        if mode not in MODES:
            raise ValueError(f"edit mode {mode!r} is not one of {MODES}")
        assignments = list(plan.assignments)
        if mode == "swap":
            assignments += _reverse(assignments, exclude={plan.filler})
        ids = [dst for dst, _ in assignments]
        if len(set(ids)) != len(ids):
            raise ValueError(f"an id would be written twice by this {mode} ({ids}): source and target words share "
                             "a token; use --mode copy or other words")
        used = ids + [i for _, mix in assignments for i in mix]
        bad = [i for i in used if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad} are outside the tables' vocabulary of {self.vocab_size}")
        chosen = self.resolve_layers(layers)
        befores, afters = [], []
        for layer in chosen:
            table = self.tables[layer]
            rows = torch.stack([_mix(table, mix) for _, mix in assignments])
            befores.append(table[ids].clone())
            afters.append(rows)
        record = EditRecord(mode, chosen, ids, torch.stack(befores).cpu(), torch.stack(afters).cpu(),
                            {"plan": plan.to_dict(), **(meta or {})})
        self._write(record, record.after)
        self.log.append(record)
        return record

    def copy_rows(self, source_ids: Sequence[int], target_ids: Sequence[int], layers: Layers = None,
                  strategy: str = "filler", filler_id: int = 0) -> EditRecord:
        """``e_src <- e_tgt`` for the source ids (length mismatch resolved by ``strategy``)."""
        return self.apply_plan(plan_rows(source_ids, target_ids, strategy, filler_id), "copy", layers)

    def swap_rows(self, source_ids: Sequence[int], target_ids: Sequence[int], layers: Layers = None,
                  strategy: str = "filler", filler_id: int = 0) -> EditRecord:
        """``e_src <-> e_tgt`` (see ``apply_plan`` for unequal lengths)."""
        return self.apply_plan(plan_rows(source_ids, target_ids, strategy, filler_id), "swap", layers)

    def edit_words(self, source_ids: Sequence[int], target_ids: Sequence[int], mode: str = "swap",
                   layers: Layers = None, strategy: str = "filler", filler_id: int = 0,
                   meta: Optional[dict] = None) -> EditRecord:
        return self.apply_plan(plan_rows(source_ids, target_ids, strategy, filler_id), mode, layers, meta)

    # ------------------------------------------------------------------------------------- undo
    @torch.no_grad()
    def undo(self, steps: Optional[int] = None) -> int:
        """Revert the last ``steps`` edits (all when None), newest first; returns how many were undone."""
        n = len(self.log) if steps is None else min(steps, len(self.log))
        for _ in range(n):
            record = self.log.pop()
            self._write(record, record.before)
        return n

    @contextlib.contextmanager
    def session(self):
        """Edits made inside are undone on exit (also on an exception)."""
        depth = len(self.log)
        try:
            yield self
        finally:
            self.undo(len(self.log) - depth)

    @torch.no_grad()
    def redo_log(self, records: Iterable[EditRecord]) -> None:
        """Re-apply saved records (e.g. ``load_log``) to these tables; they join this editor's log."""
        for record in records:
            missing = [l for l in record.layers if l not in self.tables]
            if missing or record.after.shape[-1] != self.d_ff:
                raise ValueError(f"edit log does not fit these tables (layers {missing} missing or d_ff differs)")
            before = torch.stack([self.tables[l][record.ids].clone() for l in record.layers]).cpu()
            applied = EditRecord(record.op, record.layers, record.ids, before, record.after, record.meta)
            self._write(applied, applied.after)
            self.log.append(applied)

    def _write(self, record: EditRecord, rows: torch.Tensor) -> None:
        for k, layer in enumerate(record.layers):
            table = self.tables[layer]
            table[torch.tensor(record.ids, device=table.device)] = rows[k].to(table.device, table.dtype)

    # ------------------------------------------------------------------------------------- save
    def save_log(self, path) -> Path:
        """``.pt`` (tensors) or ``.json`` (rows as base64 raw bytes: bitwise exact)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".json":
            path.write_text(json.dumps({"format": LOG_FORMAT, "edits": [r.to_dict() for r in self.log]}, indent=1))
        else:
            torch.save({"format": LOG_FORMAT, "edits": [r.to_dict(binary=True) for r in self.log]}, path)
        return path


def load_log(path) -> list[EditRecord]:
    path = Path(path)
    data = json.loads(path.read_text()) if path.suffix == ".json" else torch.load(path, weights_only=True)
    if data.get("format") != LOG_FORMAT:
        raise ValueError(f"{path} is not an edit log ({LOG_FORMAT})")
    return [EditRecord.from_dict(d) for d in data["edits"]]


def _mix(table: torch.Tensor, mix: Mapping[int, float]) -> torch.Tensor:
    items = list(mix.items())
    if len(items) == 1 and items[0][1] == 1.0:
        return table[items[0][0]].clone()  # exact copy, no arithmetic
    return sum(w * table[i].to(torch.float64) for i, w in items).to(table.dtype)


def _reverse(assignments: list[tuple[int, dict[int, float]]],
             exclude=frozenset()) -> list[tuple[int, dict[int, float]]]:
    best: dict[int, tuple[float, int]] = {}
    for dst, mix in assignments:
        for src, w in mix.items():
            if src in exclude:
                continue
            if src not in best or w > best[src][0]:
                best[src] = (w, dst)
    return [(tgt, {dst: 1.0}) for tgt, (_, dst) in best.items()]


def _encode(t: torch.Tensor) -> dict:
    t = t.detach().cpu().contiguous()
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": base64.b64encode(raw).decode("ascii")}


def _decode(d: dict) -> torch.Tensor:
    dtype = getattr(torch, d["dtype"])
    raw = bytearray(base64.b64decode(d["data"]))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(d["shape"]).clone()
