"""Input documents: which files, in which order, and their records read as chunks, whatever the format.

Formats (by name): ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst`` (DCLM's shards) hold one JSON record a line, the text
in its ``text_key`` field; ``.parquet`` (FineWeb, most Hugging Face corpora) a ``text_key`` column, read as streamed
record batches; any other file is one document. A chunk is about ``CHUNK_BYTES`` of raw records, parsed and tokenized
elsewhere (``encode.py``, in worker processes): reading here stays cheap, so one process feeds every core. Files are
read as streams, never whole, so memory does not grow with a file's size; ``decode_chunk`` turns a chunk's records
into text.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from stem_megatron.setup_check import require_extra

FORMATS = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
CHUNK_BYTES = 1 << 20  # input bytes a chunk: enough that a worker's round trip costs little, few in flight
PARQUET_ROWS = 256  # rows per record batch read from a parquet file


class BadInput(ValueError):
    """A file or record that cannot be read: the message names the file, the record and the fix."""


def format_of(path: Path) -> str:
    """``jsonl``, ``jsonl.gz``, ``jsonl.zst``, ``parquet`` or ``text`` (one document a file)."""
    name = path.name
    return next((fmt[1:] for fmt in FORMATS if name.endswith(fmt)), "text")


def expand_inputs(inputs: Iterable, pattern: str | None = None) -> list[Path]:
    """Files named in ``inputs``, directories expanded to their ``pattern`` matches (default: every file of a
    known format, ``FORMATS`` and ``*.txt``) in sorted order, which makes the dataset (and a tokenizer trained on
    it) reproducible."""
    files = []
    for item in map(Path, inputs):
        if item.is_dir():
            found = sorted(p for p in item.rglob(pattern or "*") if p.is_file())
            files += found if pattern else [p for p in found if p.name.endswith((*FORMATS, ".txt"))]
        elif item.is_file():
            files.append(item)
        else:
            raise FileNotFoundError(f"input {item} does not exist")
    if not files:
        searched = repr(pattern) if pattern else f"{', '.join(FORMATS)} and .txt files"
        raise FileNotFoundError(f"no input files in {[str(i) for i in inputs]} (directories are searched for "
                                f"{searched}; choose others with --pattern)")
    return files


@dataclass
class Chunk:
    """Raw records of one file: ``records`` are jsonl lines (bytes, blank ones kept so numbers stay right), a
    text file's bytes, or a parquet column's strings (a pyarrow array); ``first`` numbers the first record (a
    jsonl line from 1, a parquet row from 0); ``read`` the input bytes consumed since the last chunk."""

    path: str
    fmt: str
    first: int
    records: object
    read: int


def _open_jsonl(path: Path, fmt: str, raw):
    if fmt == "jsonl.gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if fmt == "jsonl.zst":
        require_extra("data", command="stem-preprocess")
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
    return raw


def _corrupt_errors():
    errors = [gzip.BadGzipFile, zlib.error, EOFError]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errors)


def _jsonl_chunks(path: Path, fmt: str) -> Iterator[Chunk]:
    with open(path, "rb") as raw, _open_jsonl(path, fmt, raw) as stream:
        lines, size, first, lineno, done = [], 0, 1, 0, 0
        try:
            for line in stream:
                lineno += 1
                lines.append(line)
                size += len(line)
                if size >= CHUNK_BYTES:
                    yield Chunk(str(path), "jsonl", first, lines, raw.tell() - done)
                    lines, size, first, done = [], 0, lineno + 1, raw.tell()
        except _corrupt_errors() as e:
            if lines:
                yield Chunk(str(path), "jsonl", first, lines, raw.tell() - done)
            raise BadInput(f"{path}: corrupt {fmt.split('.')[-1]} stream after line {lineno} ({e}); re-download "
                           f"the file, or --skip-bad keeps the lines before the damage") from None
        if lines:
            yield Chunk(str(path), "jsonl", first, lines, raw.tell() - done)


def _parquet_chunks(path: Path, text_key: str) -> Iterator[Chunk]:
    require_extra("data", command="stem-preprocess")
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise BadInput(f"{path}: not a readable parquet file ({e}); re-download it, or --skip-bad skips it") from None
    schema = parquet.schema_arrow
    if text_key not in schema.names:
        raise BadInput(f"{path} has no column {text_key!r} (columns: {schema.names}); choose the column with "
                       f"--text-key")
    column = schema.field(text_key).type
    if not (pa.types.is_string(column) or pa.types.is_large_string(column)):
        raise BadInput(f"{path}: column {text_key!r} holds {column}, not strings; choose the text column with "
                       f"--text-key")
    rows, size, first, done = parquet.metadata.num_rows, path.stat().st_size, 0, 0
    try:
        for batch in parquet.iter_batches(batch_size=PARQUET_ROWS, columns=[text_key]):
            read = size * (first + batch.num_rows) // max(rows, 1)
            yield Chunk(str(path), "parquet", first, batch.column(0), read - done)
            first, done = first + batch.num_rows, read
    except (pa.ArrowException, OSError) as e:
        raise BadInput(f"{path}: corrupt parquet data after row {first} ({e}); re-download the file, or "
                       f"--skip-bad keeps the rows before the damage") from None


def chunks(path: Path, text_key: str) -> Iterator[Chunk]:
    """The records of ``path`` in order, as chunks; a damaged file raises ``BadInput`` after the chunks read
    before the damage."""
    fmt = format_of(path)
    if fmt == "parquet":
        yield from _parquet_chunks(path, text_key)
    elif fmt == "text":
        yield Chunk(str(path), "text", 1, [path.read_bytes()], path.stat().st_size)
    else:
        yield from _jsonl_chunks(path, fmt)


def decode_chunk(chunk: Chunk, text_key: str) -> tuple[list[str], list[str]]:
    """The chunk's documents as text, and one message for each record that has none (file, record, fix)."""
    texts, bad = [], []
    if chunk.fmt == "parquet":
        for row, text in enumerate(chunk.records.to_pylist(), chunk.first):
            if text is None:
                bad.append(f"{chunk.path} row {row}: {text_key!r} is null; --skip-bad skips such rows")
            else:
                texts.append(text)
        return texts, bad
    if chunk.fmt == "text":
        try:
            return [chunk.records[0].decode("utf-8")], bad
        except UnicodeDecodeError as e:
            return texts, [f"{chunk.path} is not UTF-8 text ({e}); pass only text files or a --pattern that "
                           f"excludes it"]
    for lineno, line in enumerate(chunk.records, chunk.first):
        if not line.strip():
            continue
        where = f"{chunk.path}:{lineno}"
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            bad.append(f"{where} is not UTF-8 ({e}); --skip-bad skips such records")
            continue
        except json.JSONDecodeError as e:
            bad.append(f"{where} is not a JSON object ({e}); jsonl needs one per line")
            continue
        text = record.get(text_key) if isinstance(record, dict) else None
        if isinstance(text, str):
            texts.append(text)
        else:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            bad.append(f"{where} has no string field {text_key!r} (found {keys}); choose the field with --text-key")
    return texts, bad


def read_documents(files: Iterable[Path], text_key: str = "text") -> Iterator[str]:
    """Documents in order, as text, in this process (what a tokenizer trains on); the first bad record raises
    ``BadInput``."""
    for path in map(Path, files):
        for chunk in chunks(path, text_key):
            texts, bad = decode_chunk(chunk, text_key)
            if bad:
                raise BadInput(bad[0])
            yield from texts
