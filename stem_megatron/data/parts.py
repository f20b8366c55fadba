"""Indexed datasets written so that a kill never leaves one that looks complete, and joined in order.

A dataset is written under hidden temporary names, fsynced, then renamed: ``.bin`` first, ``.idx`` last, so a
prefix whose ``.idx`` exists and matches its ``.bin`` (``check_indexed_dataset``) is complete. A part's ``.json``
records what it was made from (its files' names and sizes, the tokenizer and settings): a rerun reuses the part
only if that still holds. Joining is megatron's ``IndexedDatasetBuilder.add_index``, in order.
"""

from __future__ import annotations

import glob
import json
import os
import socket
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from stem_megatron.data.integrity import DataError, check_indexed_dataset
from stem_megatron.durable import fsync_dir, fsync_file, write_synced


def is_complete(prefix: Path) -> bool:
    """Whether ``prefix.idx`` and ``prefix.bin`` form a complete dataset."""
    try:
        check_indexed_dataset(prefix)
        return True
    except (DataError, OSError):
        return False


def temporary(prefix: Path) -> Path:
    """A name beside ``prefix`` no other process uses (two jobs of one shard, even on two nodes, write apart)."""
    return prefix.with_name(f".{prefix.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def remove_temporaries(prefix: Path) -> None:
    """What writers of ``prefix`` killed mid-write left (a whole dataset's size, at worst)."""
    for stale in prefix.parent.glob(f".{glob.escape(prefix.name)}.tmp-*"):
        stale.unlink(missing_ok=True)


class DatasetWriter:
    """``with DatasetWriter(prefix, dtype) as out: out.add(tokens, lengths)``: documents appended in order;
    ``prefix`` appears, complete, only when the block ends without an error."""

    def __init__(self, prefix: Path, dtype):
        self.prefix, self.dtype, self._tmp = Path(prefix), dtype, temporary(Path(prefix))

    def __enter__(self) -> "DatasetWriter":
        self._builder = IndexedDatasetBuilder(f"{self._tmp}.bin", dtype=self.dtype)
        return self

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Documents of ``lengths`` tokens each, back to back in ``tokens``."""
        start = 0
        for length in lengths.tolist():
            self._builder.add_document(tokens[start: start + length], [length])
            start += length

    def join(self, prefix: Path) -> None:
        """Every document of the complete dataset ``prefix``, after those added so far."""
        self._builder.add_index(str(prefix))

    def __exit__(self, error_type, error, traceback):
        if error_type is not None:
            self._builder.data_file.close()
            for suffix in (".bin", ".idx"):
                Path(f"{self._tmp}{suffix}").unlink(missing_ok=True)
            return None
        self._builder.finalize(f"{self._tmp}.idx")
        for suffix in (".bin", ".idx"):
            fsync_file(f"{self._tmp}{suffix}")
        for suffix in (".bin", ".idx"):
            os.replace(f"{self._tmp}{suffix}", f"{self.prefix}{suffix}")
        fsync_dir(self.prefix.parent)
        return None


def move(source: Path, prefix: Path) -> None:
    """The complete dataset ``source`` renamed to ``prefix`` (``.bin`` first, ``.idx`` last: complete when seen)."""
    for suffix in (".bin", ".idx"):
        os.replace(f"{source}{suffix}", f"{prefix}{suffix}")
    fsync_dir(prefix.parent)


def write_record(prefix: Path, made_from: dict, counts: dict) -> None:
    """``prefix.json``: what the dataset at ``prefix`` is made from, and its counts (written before the dataset is
    renamed in)."""
    write_synced(Path(f"{prefix}.json"), json.dumps({"made_from": made_from, **counts}, indent=1))


def _record(prefix: Path) -> dict:
    return json.loads(Path(f"{prefix}.json").read_text())


def reusable(prefix: Path, made_from: dict) -> bool:
    """Whether ``prefix`` is complete and made from ``made_from``."""
    try:
        return _record(prefix)["made_from"] == made_from and is_complete(prefix)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def counts(prefix: Path) -> dict:
    """The counts ``write_record`` stored with ``prefix``."""
    return {key: value for key, value in _record(prefix).items() if key != "made_from"}


def recorded_inputs(prefix: Path) -> dict:
    """What ``write_record`` says ``prefix`` is made from."""
    return _record(prefix)["made_from"]


def remove(prefix: Path) -> None:
    for suffix in (".bin", ".idx", ".json"):
        Path(f"{prefix}{suffix}").unlink(missing_ok=True)
