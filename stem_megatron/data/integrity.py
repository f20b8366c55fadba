"""Integrity of the data: a megatron indexed dataset (``prefix.idx`` + ``prefix.bin``) before training
reads it, and token ids against the vocabulary.

megatron-core's ``IndexedDataset`` reports damage opaquely and late: a truncated ``.idx`` header
raises ``struct.error: unpack requires a buffer of 8 bytes``, a truncated body ``ValueError: buffer is
smaller than requested size``, a foreign file ``AssertionError: bad header`` (gone under ``python -O``),
each followed by ``Exception ignored in __del__`` noise; a truncated ``.bin`` opens fine and fails
only when training reaches the missing sample. This check reads the documented layout itself (header
magic, version, dtype, counts; file sizes the counts imply), so megatron only ever opens sound files,
and a failure names the file, the problem and the fix.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
FIX = "re-run stem-preprocess (or `python -m stem_megatron.data.corpus` for the demo corpus) to rebuild it"


class DataError(ValueError):
    """Bad data: the message names the file or the token id, the problem and the fix."""


def check_token_ids(tokens, vocab_size):
    """Raise DataError if any id is outside ``[0, vocab_size)``.

    Out-of-range ids would otherwise surface as an opaque embedding index error (or a device-side
    assert on GPU). The min/max check keeps the common, valid case cheap.
    """
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo >= 0 and hi < vocab_size:
        return
    ids = tokens.cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    bad = tuple(np.argwhere((ids < 0) | (ids >= vocab_size))[0].tolist())
    position = bad[0] if len(bad) == 1 else bad
    token = int(ids[bad])
    problem = "negative" if token < 0 else f">= vocab_size {vocab_size}"
    raise DataError(
        f"token id {token} at position {position} is {problem} (vocab_size {vocab_size}); the tokenizer "
        f"and model.vocab_size disagree: model.vocab_size must cover every tokenizer id"
    )


def _fail(path, problem):
    raise DataError(f"{path}: {problem}; {FIX}")


def _size_problem(actual, expected, what):
    kind = "truncated" if actual < expected else "corrupt"
    return f"{kind}: {actual} bytes, but {what} implies {expected}"


def _header(prefix) -> tuple[Path, Path, type, int, int]:
    """``.idx`` and ``.bin`` paths, token dtype, sequence and document counts, from the sound header of ``prefix``."""
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    for path in (idx, bin_):
        if not path.is_file():
            _fail(path, "missing")
    with idx.open("rb") as f:
        header = f.read(_HEADER.size)
    if len(header) < _HEADER.size:
        _fail(idx, f"truncated header: {idx.stat().st_size} bytes, a megatron index header has {_HEADER.size}")
    magic, version, code, num_seqs, num_docs = _HEADER.unpack(header)
    if magic != _INDEX_HEADER:
        _fail(idx, f"corrupt header: magic {magic!r} is not megatron's {_INDEX_HEADER!r}")
    if version != 1:
        _fail(idx, f"corrupt header: version {version}, megatron-core reads version 1")
    if code not in [d.value for d in DType]:
        _fail(idx, f"corrupt header: unknown token dtype code {code}")
    return idx, bin_, DType.dtype_from_code(code), num_seqs, num_docs


def token_count(prefix) -> int:
    """``prefix``'s tokens from its header's dtype and its ``.bin``'s size: no data read, so a blend of hundreds of
    parts is weighed at once; exact for every dataset ``check_indexed_dataset`` passes, as all must before training."""
    _, bin_, dtype, _, _ = _header(prefix)
    return bin_.stat().st_size // np.dtype(dtype).itemsize


def recorded_max_id(prefix, num_tokens: int) -> int | None:
    """The largest token id stem-preprocess recorded writing ``prefix`` (``prefix.json``), if that record counts
    ``num_tokens`` tokens (a dataset rewritten by another tool since has its own count); else None. It spares every
    rank a read of the whole ``.bin`` (an hour of one core per rank for 1T tokens)."""
    try:
        record = json.loads(Path(f"{prefix}.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("tokens") != num_tokens or not isinstance(record.get("max_id"), int):
        return None
    return record["max_id"]


def check_indexed_dataset(prefix, vocab_size=None) -> int:
    """Raise DataError unless ``prefix.{idx,bin}`` form a complete dataset; returns its token count.

    With ``vocab_size`` every token id is also checked to lie in ``[0, vocab_size)`` (one min/max pass
    over the memory-mapped tokens, or the largest id stem-preprocess recorded), so a tokenizer/model vocabulary
    mismatch fails here.
    """
    idx, bin_, dtype, num_seqs, num_docs = _header(prefix)
    idx_size = idx.stat().st_size
    expected = _HEADER.size + num_seqs * (4 + 8) + num_docs * 8  # int32 lengths, int64 pointers, int64 doc ends
    if idx_size != expected:
        _fail(idx, _size_problem(idx_size, expected, f"its header ({num_seqs} sequences, {num_docs} document marks)"))
    lengths = np.fromfile(idx, dtype=np.int32, count=num_seqs, offset=_HEADER.size)
    doc_ends = np.fromfile(idx, dtype=np.int64, count=num_docs, offset=_HEADER.size + 12 * num_seqs)
    if num_docs == 0 or doc_ends[-1] != num_seqs or (lengths < 0).any():
        _fail(idx, "corrupt index: document marks or sequence lengths are inconsistent")
    num_tokens = int(lengths.sum(dtype=np.int64))
    bin_size = bin_.stat().st_size
    if bin_size != num_tokens * np.dtype(dtype).itemsize:
        _fail(bin_, _size_problem(bin_size, num_tokens * np.dtype(dtype).itemsize,
                                  f"{idx.name} ({num_tokens} {np.dtype(dtype).name} tokens)"))
    if vocab_size is not None and num_tokens:
        max_id = recorded_max_id(prefix, num_tokens)
        if max_id is None or max_id >= vocab_size:  # a recorded largest id within the vocabulary needs no read
            try:
                check_token_ids(np.memmap(bin_, dtype=dtype, mode="r"), vocab_size)
            except DataError as e:
                raise DataError(f"{bin_}: {e} (or the dataset was tokenized with another tokenizer: re-run "
                                 f"stem-preprocess with this run's tokenizer.json)") from None
    return num_tokens


def data_config_problem(data) -> tuple[str, str] | None:
    """The first problem of a run's ``data`` config (``config.DataConfig``) as (field, message), or None: the blend's
    shape and weights, and every prefix complete on disk (header and sizes; token ids are checked against the
    vocabulary when the datasets are built). ``data.dir`` itself is checked by ``setup_check.corpus_problem``."""
    if data.blend is not None and len(data.blend) == 0:
        return "data.blend", "is empty: give [[weight, prefix], ...] or null"
    for i, entry in enumerate(data.blend or []):
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], str)):
            return f"data.blend[{i}]", f"{entry!r} is not a [weight, prefix] pair"
        if not (isinstance(entry[0], (int, float)) and entry[0] > 0):
            return f"data.blend[{i}]", f"weight {entry[0]!r} must be a number > 0"
    if data.valid_samples is not None and data.valid_samples < 1:
        return "data.valid_samples", "must be >= 1 or null"
    try:
        train_blend = data.train_blend()  # directories and globs expanded (data/blend.py)
    except DataError as e:  # blend.BlendError names its entry
        return getattr(e, "field", "data.blend"), str(e)
    for field_name, prefixes in (("data.blend", [p for _, p in train_blend]),
                                 ("data.valid_prefixes", data.valid_prefix_paths())):
        for prefix in prefixes:
            try:
                check_indexed_dataset(prefix)
            except DataError as e:
                return field_name, str(e)
    return None
