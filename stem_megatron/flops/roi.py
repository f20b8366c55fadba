"""Training ROI (paper §4, Table 3): average accuracy / training FLOPs, normalised to a baseline row.

Rows come from a results JSON or CSV; a row's training FLOPs are given, or training tokens x the exact
training FLOPs per token of its preset and variant.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from stem_megatron.flops.arch import DEFAULT_SEQ_LENGTH, FlopsError, load_arch, read_mapping
from stem_megatron.flops.counts import training_flops
from stem_megatron.flops.variants import parse_variant

# results-file column -> the spellings accepted for it (after normalising case, spaces and dashes)
_ALIASES = {
    "name": ("name", "model"),
    "avg_accuracy": ("avg_accuracy", "avg", "accuracy", "avg_acc"),
    "training_tokens": ("training_tokens", "tokens", "train_tokens"),
    "preset": ("preset",),
    "variant": ("variant",),
    "ratio": ("ratio",),
    "expert_ffn": ("expert_ffn", "expert_ffn_hidden_size"),
    "seq_length": ("seq_length", "seq_len"),
    "gflops_per_token": ("gflops_per_token", "gflops"),
    "flops_per_token": ("flops_per_token",),
    "training_flops": ("training_flops", "train_flops"),
    "group": ("group", "scale"),
    "baseline": ("baseline",),
}


def load_results(path: str | Path) -> list[dict]:
    """Rows from a JSON list (or {"rows": [...]}) or a CSV with a header; keys are normalised
    (case, spaces and dashes) and aliases resolved (see _ALIASES)."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        try:
            with path.open(newline="", encoding="utf-8") as f:
                raw = list(csv.DictReader(f))
        except OSError as e:
            raise FlopsError(f"{path}: cannot read ({e.strerror})") from None
    else:
        data = read_mapping(path)
        raw = data.get("rows") if isinstance(data, Mapping) else data
        if not isinstance(raw, list):
            raise FlopsError(f"{path}: expected a list of rows or {{\"rows\": [...]}}")
    rows = []
    for i, r in enumerate(raw):
        if not isinstance(r, Mapping):
            raise FlopsError(f"{path}: row {i + 1} is not a mapping")
        norm = {str(k).strip().lower().replace(" ", "_").replace("-", "_"): v for k, v in r.items()}
        row = {}
        for key, names in _ALIASES.items():
            for n in names:
                if norm.get(n) not in (None, ""):
                    row[key] = norm[n]
                    break
        row["_where"] = f"{path} row {i + 1}" + (f" ({row['name']})" if "name" in row else "")
        rows.append(row)
    return rows


def _number(row: dict, key: str) -> float:
    try:
        value = float(row[key])
    except KeyError:
        raise FlopsError(f"{row['_where']}: missing field '{key}'") from None
    except (TypeError, ValueError):
        raise FlopsError(f"{row['_where']}: field '{key}' is not a number: {row[key]!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise FlopsError(f"{row['_where']}: field '{key}' must be positive, got {row[key]!r}")
    return value


def _truthy(value: Any) -> bool:
    return value is True or str(value).strip().lower() in ("1", "true", "yes", "y")


def row_training_flops(row: dict, seq_length: int | None = None) -> tuple[float, str]:
    """Training FLOPs of one results row and how they were obtained."""
    if "training_flops" in row:
        return _number(row, "training_flops"), "training_flops (given)"
    tokens = _number(row, "training_tokens")
    if "flops_per_token" in row:
        return tokens * _number(row, "flops_per_token"), "tokens x flops_per_token (given)"
    if "gflops_per_token" in row:
        return tokens * 1e9 * _number(row, "gflops_per_token"), "tokens x gflops_per_token (given)"
    if "preset" not in row:
        raise FlopsError(f"{row['_where']}: missing field 'preset' (or 'training_flops' / 'flops_per_token' / "
                         f"'gflops_per_token')")
    arch = load_arch(str(row["preset"]))
    variant = parse_variant(str(row.get("variant", "dense")))
    if "ratio" in row and variant.variant != "dense":
        variant = replace(variant, ratio=str(row["ratio"]))
    if "expert_ffn" in row:
        variant = replace(variant, expert_ffn_hidden_size=int(_number(row, "expert_ffn")))
    L = int(_number(row, "seq_length")) if "seq_length" in row else seq_length or arch.seq_length or \
        DEFAULT_SEQ_LENGTH
    per_token = training_flops(arch, L, variant)["total"] / L
    return tokens * per_token, f"tokens x exact training FLOPs/token ({arch.name}, {variant.label}, L={L})"


def training_roi(rows: list[dict], baseline: str | None = None, seq_length: int | None = None) -> list[dict]:
    """ROI = avg accuracy / training FLOPs, and ROI / ROI of the baseline in the row's group (rows group
    by 'group', else 'preset'). Baseline per group: ``baseline`` (a row name, all groups), else the row
    flagged ``baseline``, else the group's dense row."""
    out = []
    for row in rows:
        if "name" not in row:
            raise FlopsError(f"{row['_where']}: missing field 'name'")
        acc = _number(row, "avg_accuracy")
        flops, how = row_training_flops(row, seq_length)
        group = str(row.get("group", row.get("preset", "")))
        out.append({"name": str(row["name"]), "group": group, "avg_accuracy": acc, "training_flops": flops,
                    "flops_from": how, "roi": acc / flops, "_row": row})
    by_group: dict[str, list[dict]] = {}
    for r in out:
        by_group.setdefault(r["group"], []).append(r)
    if baseline is not None:
        named = [r for r in out if r["name"] == baseline]
        if not named:
            raise FlopsError(f"--baseline {baseline!r} is not a row name ({', '.join(r['name'] for r in out)})")
    for group, members in by_group.items():
        if baseline is not None:
            base = named[0]
        else:
            flagged = [r for r in members if _truthy(r["_row"].get("baseline", False))]
            dense = [r for r in members if str(r["_row"].get("variant", "")).strip().lower() == "dense"]
            base = (flagged or dense or [None])[0]
            if base is None:
                raise FlopsError(f"group {group!r} has no baseline row: flag one with 'baseline: true', give it "
                                 f"variant 'dense', or pass --baseline NAME")
        for r in members:
            r["baseline"] = base["name"]
            r["roi_normalised"] = r["roi"] / base["roi"]
    for r in out:
        del r["_row"]
    return out


def print_roi(rows: list[dict]) -> None:
    """The ``training_roi`` rows as a table, and where their training FLOPs came from."""
    print(f"{'model':<20}{'group':<16}{'avg acc':>9}{'train FLOPs':>14}{'ROI (norm.)':>13}  baseline")
    for r in rows:
        print(f"{r['name']:<20}{r['group']:<16}{r['avg_accuracy']:>9.2f}{r['training_flops']:>14.4g}"
              f"{r['roi_normalised']:>12.2f}x  {r['baseline']}")
    exact = sum(r["flops_from"].startswith("tokens x exact") for r in rows)
    parts = [f"{exact} row(s): training tokens x exact training matmul FLOPs/token of preset + variant"] if exact \
        else []
    if len(rows) > exact:
        parts.append(f"{len(rows) - exact} row(s): given in the file")
    print("training FLOPs: " + "; ".join(parts) + " (details: --json, 'flops_from')")
