"""stem-preprocess at scale: every format gives the plain jsonl's bytes, any number of workers, shards joined by
--merge, a rerun after a kill, bad input named in one line (or skipped and counted), progress in a log."""

import gzip
import importlib.util
import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from stem_megatron.data import documents, preprocess as preprocess_module
from stem_megatron.data.integrity import DataError, check_indexed_dataset
from stem_megatron.data.preprocess import main, merge, preprocess, write_indexed_dataset
from stem_megatron.data.progress import Progress
from stem_megatron.data.shards import parse_shard, shard_range
from stem_megatron.data.tokenizer import HFTokenizer


def _docs(seed, n):
    rng = np.random.default_rng(seed)
    words = ["def", "return", "the", "value", "naïve", "Ω", "list", "of", "x", "\n", "  "]
    return [" ".join(rng.choice(words, rng.integers(1, 60))) for _ in range(n)]


def _jsonl(docs, key="text"):
    return "".join(json.dumps({"id": i, key: d}) + "\n" for i, d in enumerate(docs)).encode()


def _write(path, docs, key="text"):
    """``docs`` as ``path``'s format (by its name)."""
    if path.name.endswith(".parquet"):
        pq.write_table(pa.table({"url": [f"u{i}" for i in range(len(docs))], key: docs}), path, row_group_size=7)
    elif path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(_jsonl(docs, key)))
    elif path.name.endswith(".zst"):
        path.write_bytes(zstandard.ZstdCompressor().compress(_jsonl(docs, key)))
    else:
        path.write_bytes(_jsonl(docs, key))
    return path


def _bytes(prefix):
    return prefix.with_suffix(".bin").read_bytes(), prefix.with_suffix(".idx").read_bytes()


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return corpus / "tokenizer.json"


@pytest.fixture(scope="module")
def shards_in(tmp_path_factory):
    """Six files of every format, 40 documents each, and the documents in order."""
    root = tmp_path_factory.mktemp("inputs")
    names = ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet", "e.jsonl.zst", "f.parquet"]
    docs = [_docs(i, 40) for i in range(len(names))]
    for name, some in zip(names, docs):
        _write(root / name, some)
    return root, [d for some in docs for d in some]


@pytest.fixture(scope="module")
def reference(shards_in, tokenizer, tmp_path_factory):
    """The documents written in this process, one by one (the layout every other way must give)."""
    prefix = tmp_path_factory.mktemp("reference") / "train"
    write_indexed_dataset(shards_in[1], HFTokenizer(tokenizer), prefix)
    return _bytes(prefix)


def test_every_format_gives_the_plain_jsonl_bytes(shards_in, reference, tokenizer, tmp_path):
    root, docs = shards_in
    plain = preprocess([_write(tmp_path / "all.jsonl", docs)], tmp_path / "plain" / "train", tokenizer)
    assert _bytes(tmp_path / "plain" / "train") == reference and plain["docs"] == len(docs)
    for fmt in ("jsonl.gz", "jsonl.zst", "parquet"):
        preprocess([_write(tmp_path / f"all.{fmt}", docs)], tmp_path / fmt / "train", tokenizer)
        assert _bytes(tmp_path / fmt / "train") == reference, fmt
    # a directory of mixed formats, read in name order
    stats = preprocess([root], tmp_path / "dir" / "train", tokenizer)
    assert _bytes(tmp_path / "dir" / "train") == reference and stats["files"] == 6


def test_workers_parts_and_shards_give_one_process_bytes(shards_in, reference, tokenizer, tmp_path, monkeypatch):
    """Two workers over many small chunks and parts; two shards joined by --merge: the same bytes."""
    root, _ = shards_in
    monkeypatch.setattr(documents, "CHUNK_BYTES", 300)
    monkeypatch.setattr(documents, "PARQUET_ROWS", 5)
    part_mb = 1e-9  # a part a file
    stats = preprocess([root], tmp_path / "w2" / "train", tokenizer, workers=2, part_mb=part_mb)
    assert _bytes(tmp_path / "w2" / "train") == reference and stats["reused_parts"] == 0
    files = []
    for i in (1, 0):
        shard = preprocess([root], tmp_path / "s" / "train", tokenizer, workers=2, shard=f"{i}/2", part_mb=part_mb)
        assert shard["prefix"].endswith(f"train-0000{i}-of-00002")
        files.append(shard["files"])
    assert sum(files) == 6 and min(files) > 0
    assert not (tmp_path / "s" / "train-00000-of-00002.parts").exists()
    merged = merge(tmp_path / "s" / "train")
    assert _bytes(tmp_path / "s" / "train") == reference and merged["shards"] == 2
    assert merge(tmp_path / "s" / "train")["reused"]


def test_a_rerun_after_a_kill_finishes_what_is_left(shards_in, reference, tokenizer, tmp_path, monkeypatch):
    root, _ = shards_in
    written = []
    real = preprocess_module._write_part

    def killed_in_the_fourth_part(results, prefix, *args):
        if len(written) == 3:
            next(results)  # mid-part
            raise KeyboardInterrupt
        real(results, prefix, *args)
        written.append(prefix)

    monkeypatch.setattr(preprocess_module, "_write_part", killed_in_the_fourth_part)
    with pytest.raises(KeyboardInterrupt):
        preprocess([root], tmp_path / "train", tokenizer, workers=2, part_mb=1e-9)
    assert not (tmp_path / "train.idx").exists()  # nothing claims to be complete
    assert sorted(p.name for p in (tmp_path / "train.parts").glob("*.idx")) == [p.name + ".idx" for p in written]
    monkeypatch.setattr(preprocess_module, "_write_part", real)
    stats = preprocess([root], tmp_path / "train", tokenizer, workers=2, part_mb=1e-9)
    assert _bytes(tmp_path / "train") == reference and stats["reused_parts"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json", "train.bin", "train.idx", "train.json"]
    assert preprocess([root], tmp_path / "train", tokenizer)["reused"]  # complete: left as it is
    with pytest.raises(FileExistsError, match=r"train\.idx exists and is made from other inputs or settings: "
                                              r"delete .*train\.bin"):
        preprocess([root / "a.jsonl"], tmp_path / "train", tokenizer)


def test_the_recorded_largest_id_spares_reading_the_tokens(shards_in, tokenizer, tmp_path):
    """The token-id check against the vocabulary reads stem-preprocess's record, not the .bin, while the record
    counts the dataset's tokens; a dataset rewritten since (another count) is read whole."""
    root, docs = shards_in
    stats = preprocess([root / "a.jsonl"], tmp_path / "train", tokenizer)
    tokens = np.fromfile(tmp_path / "train.bin", dtype=np.uint16)
    record = json.loads((tmp_path / "train.json").read_text())
    assert record["max_id"] == tokens.max() and record["tokens"] == stats["tokens"] == len(tokens)
    with pytest.raises(DataError, match=f"token id {tokens.max()} .* is >= vocab_size {tokens.max()}"):
        check_indexed_dataset(tmp_path / "train", vocab_size=int(tokens.max()))
    largest = int(tokens.max())
    tokens[7] = 60000  # the .bin changed behind the record's back: the record still speaks for it
    tokens.tofile(tmp_path / "train.bin")
    assert check_indexed_dataset(tmp_path / "train", vocab_size=largest + 1) == len(tokens)
    (tmp_path / "train.json").write_text(json.dumps({**record, "tokens": len(tokens) + 1}))
    with pytest.raises(DataError, match="token id 60000 at position 7 is >= vocab_size"):
        check_indexed_dataset(tmp_path / "train", vocab_size=4096)


def _corrupt(data: bytes) -> bytes:
    return data[: len(data) // 2] + bytes(64) + data[len(data) // 2 + 64:]


@pytest.mark.parametrize("name, make, message", [
    ("x.jsonl.zst", lambda p: p.write_bytes(_corrupt(zstandard.ZstdCompressor().compress(_jsonl(_docs(3, 400)))))
     , r"x\.jsonl\.zst: corrupt zst stream after line \d+"),
    ("x.jsonl.gz", lambda p: p.write_bytes(gzip.compress(_jsonl(_docs(3, 400)))[:-30]),
     r"x\.jsonl\.gz: corrupt gz stream after line \d+"),
    ("x.parquet", lambda p: _write(p, _docs(3, 5), key="body"),
     r"x\.parquet has no column 'text' \(columns: \['url', 'body'\]\); choose the column with --text-key"),
    ("x.jsonl", lambda p: p.write_bytes(b'{"text": "a"}\n\n{"body": "b"}\n'),
     r"x\.jsonl:3 has no string field 'text' \(found \['body'\]\)"),
    ("x.jsonl", lambda p: p.write_bytes(b'{"text": "a"}\n{"text": "caf\xe9"}\n'), r"x\.jsonl:2 is not UTF-8"),
])
def test_bad_input_is_one_line_naming_file_and_record(name, make, message, tokenizer, tmp_path, capsys):
    make(tmp_path / name)
    good = _write(tmp_path / "ok.jsonl", _docs(4, 10))
    args = ["--input", str(good), str(tmp_path / name), "--output-prefix", str(tmp_path / "out" / "train"),
            "--tokenizer", str(tokenizer), "--workers", "1"]  # the workers' path: the tests above
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("stem-preprocess: error: ")
    assert __import__("re").search(message, err), err
    assert not (tmp_path / "out" / "train.idx").exists()
    main([*args, "--skip-bad"])
    out = capsys.readouterr().out
    assert "skipped 1 bad records or damaged files (first: " in out and out.count("\n") == 1
    assert preprocess([good], tmp_path / "good" / "train", tokenizer)["docs"] <= \
        json.loads((tmp_path / "out" / "train.json").read_text())["docs"]


def test_progress_lines_in_a_log():
    stream = io.StringIO()
    progress = Progress(4_000_000_000, 1_000_000_000, stream, log_every_s=0)
    progress.update(500_000_000, 1234, 2_000_000)
    line = stream.getvalue()
    assert line.startswith("stem-preprocess: 1.50 of 4.00 GB input (38%), 1,234 docs, 2,000,000 tokens, ")
    assert "MB/s" in line and "M tokens/s, ETA " in line and line.count("\n") == 1


def test_shards_default_to_the_slurm_array_and_balance_bytes(monkeypatch):
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    assert parse_shard(None) == (0, 1)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "5")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "1")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "8")
    assert parse_shard(None) == (4, 8) and parse_shard("3/64") == (3, 64)
    with pytest.raises(ValueError, match="--shard 4/4: I must be in 0..N-1"):
        parse_shard("4/4")
    sizes = [10, 10, 10, 10, 40, 10, 5, 5]
    assert [list(shard_range(sizes, i, 3)) for i in range(3)] == [[0, 1, 2], [3, 4], [5, 6, 7]]
    with pytest.raises(ValueError, match="the input has 8 files, fewer than 9 shards; use at most 8 shards"):
        shard_range(sizes, 0, 9)


def test_the_benchmark_at_its_smallest(tokenizer, source_dir, capsys):
    """benchmarks/preprocess.py: every way side by side against encode_batch, the scaling, the projection."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "preprocess.py"
    spec = importlib.util.spec_from_file_location("preprocess_benchmark", path)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    benchmark.main(["--tokenizer", str(tokenizer), "--source-dir", str(source_dir), "--max-mb", "0.05", "--rounds",
                    "1", "--workers", "1", "2", "--zst"])
    out = capsys.readouterr().out
    rows = {line[:40].strip(): line[40:].split() for line in out.splitlines() if line.startswith(("encode", "stem"))}
    rows_per_cpu = {name: row[2:] for name, row in rows.items()}
    assert set(rows) == {"encode_batch, all cores", *(f"stem-preprocess {fmt} --workers {w}" for fmt in
                                                      ("jsonl", "jsonl.zst") for w in (1, 2))}
    for table in (rows, rows_per_cpu):
        ceiling = float(table["encode_batch, all cores"][0])
        assert all(abs(float(ratio) - float(rate) / ceiling) < 0.01 + 0.006 / ceiling for rate, ratio, *_ in
                   table.values())
    assert "scaling --workers 2 / --workers 1: " in out and " tokens per CPU-second (the slowest way above) on 1,024 cores: " in out
