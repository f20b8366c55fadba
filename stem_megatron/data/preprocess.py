"""``stem-preprocess``: documents (jsonl, jsonl.gz/zst, parquet or text files) -> megatron indexed dataset (.bin/.idx).

Each document becomes one sequence followed by the EOD token, as megatron's own preprocessing writes them;
``GPTDataset`` packs documents into fixed-length samples later. Without ``--tokenizer`` a byte-level BPE is trained
on the input first (``--vocab-size``) and saved next to the output. The work runs on every core (``--workers``),
across nodes (``--shard I/N``, then ``--merge`` or a blend of the shards), resumes after a kill, and gives the same
bytes whatever the split (docs/preprocessing.md).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import itertools
import multiprocessing
import os
import shutil
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset

from stem_megatron.data import encode
from stem_megatron.data.documents import BadInput, Chunk, chunks, expand_inputs, format_of, read_documents
from stem_megatron.data.parts import (DatasetWriter, counts, is_complete, move, recorded_inputs, remove_temporaries,
                                     reusable, temporary, write_record)
from stem_megatron.data.progress import Progress
from stem_megatron.data.shards import PART_MB, Part, default_workers, parse_shard, plan_parts, shard_prefix, shard_range
from stem_megatron.data.tokenizer import HFTokenizer, train_tokenizer
from stem_megatron.setup_check import require_extra


def write_indexed_dataset(docs: Iterable[str], tokenizer: HFTokenizer, prefix, batch_size: int = 256) -> dict:
    """Write ``prefix.bin``/``prefix.idx`` from documents in this process: per document its tokens + EOD; returns
    doc and token counts. The dtype is the one megatron's preprocessing picks for the vocabulary (uint16 below
    65500 ids)."""
    num_docs = num_tokens = 0
    docs = iter(docs)
    with DatasetWriter(Path(prefix), DType.optimal_dtype(tokenizer.vocab_size)) as out:
        while batch := list(itertools.islice(docs, batch_size)):
            ids = [doc + [tokenizer.eod] for doc in tokenizer.tokenize_batch(batch)]
            out.add(np.concatenate([np.asarray(doc) for doc in ids]), np.array([len(doc) for doc in ids]))
            num_docs, num_tokens = num_docs + len(ids), num_tokens + sum(map(len, ids))
        if num_docs == 0:
            raise ValueError(f"no documents for {prefix}: every input was empty")
    return {"docs": num_docs, "tokens": num_tokens}


def _beside(tokenizer: Path, data_dir: Path) -> Path:
    """``tokenizer`` copied into ``data_dir`` as its ``tokenizer.json`` (a run reads ``data.dir/tokenizer.json``: a
    Hugging Face model's, ``stem-preprocess --tokenizer MODEL_DIR/tokenizer.json``); one already there must be it.
    The copy appears whole (shards on other nodes may look at the same time)."""
    if not tokenizer.is_file():
        raise FileNotFoundError(f"tokenizer {tokenizer} does not exist")
    there = data_dir / "tokenizer.json"
    if not there.exists():
        copy = temporary(there)
        shutil.copyfile(tokenizer, copy)
        os.replace(copy, there)
    elif there.read_bytes() != tokenizer.read_bytes():
        raise ValueError(f"{there} is another tokenizer than {tokenizer}: the datasets of one data dir share one "
                         f"tokenizer; write these to another directory")
    return there


@dataclass
class _Damaged:
    """A file that could not be read to its end, in document order (``BadInput``'s message)."""

    message: str


def _items(parts: list[Part], text_key: str) -> Iterator[Chunk | _Damaged | Part]:
    """Every chunk of ``parts`` in order, a damaged file's message where its reading stopped, each part after its
    last chunk (the end of its output)."""
    for part in parts:
        for path in part.files:
            try:
                yield from chunks(Path(path), text_key)
            except BadInput as e:
                yield _Damaged(str(e))
        yield part


def _encoded(items: Iterator, workers: int, start_args: tuple) -> Iterator:
    """``items`` with each chunk replaced by ``encode.encode(chunk)``, in order: in this process for one worker, else
    in ``workers`` forked processes with at most ``2 * workers + 1`` chunks in flight (memory bounded by chunks, not
    files)."""
    if workers == 1:
        encode.start(*start_args)
        yield from (encode.encode(item) if isinstance(item, Chunk) else item for item in items)
        return
    context = multiprocessing.get_context("fork")  # workers start in milliseconds, the tokenizer's module loaded
    # set before the fork: the children tokenize on their own thread, and a thread pool this process's tokenizer
    # training started is not theirs to use (tokenizers would warn of it in each child otherwise)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=encode.start_worker,
                               initargs=(os.getpid(), *start_args))
    window: deque = deque()
    try:
        for item in items:
            window.append(pool.submit(encode.encode, item) if isinstance(item, Chunk) else item)
            while len(window) > 2 * workers or (window and not isinstance(window[0], Future)):
                head = window.popleft()
                yield head.result() if isinstance(head, Future) else head
        while window:
            head = window.popleft()
            yield head.result() if isinstance(head, Future) else head
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _write_part(results: Iterator, prefix: Path, dtype, made_from: dict, skip_bad: bool, progress: Progress) -> None:
    """One part's documents from ``results`` (up to its end marker) into ``prefix``, atomically."""
    docs = tokens = 0
    max_id = -1
    bad: list[str] = []
    with DatasetWriter(prefix, dtype) as out:
        for item in results:
            if isinstance(item, Part):
                break
            if isinstance(item, _Damaged):
                found = [item.message]
            else:
                chunk_tokens, lengths, found, read = item
                out.add(chunk_tokens, lengths)
                docs, tokens = docs + len(lengths), tokens + len(chunk_tokens)
                max_id = max(max_id, int(chunk_tokens.max())) if len(chunk_tokens) else max_id
                progress.update(read, len(lengths), len(chunk_tokens))
            if found and not skip_bad:
                raise BadInput(found[0])
            bad += found
        write_record(prefix, made_from, {"docs": docs, "tokens": tokens, "max_id": max_id, "bad": len(bad),
                                         "first_bad": bad[0] if bad else None})


def _made_from(parts: list[Part], settings: dict) -> dict:
    """What an output is made from: its input files and sizes, and ``settings`` (the tokenizer's digest, the reading
    settings)."""
    return {"files": [str(Path(f).resolve()) for part in parts for f in part.files],
            "sizes": [s for part in parts for s in part.sizes], **settings}


def _tokenizer_for(files, prefix: Path, tokenizer, vocab_size, text_key: str, shards: int) -> Path:
    if (tokenizer is None) == (vocab_size is None):
        raise ValueError("give exactly one of --tokenizer (reuse a tokenizer.json) or --vocab-size (train one)")
    if tokenizer is not None:
        return _beside(Path(tokenizer), prefix.parent)
    if shards > 1:
        raise ValueError("--shard needs --tokenizer: every shard must use one tokenizer; train it once first "
                         "(stem-preprocess --vocab-size N on a sample), then pass its tokenizer.json")
    tokenizer = prefix.parent / "tokenizer.json"
    if tokenizer.exists():
        raise FileExistsError(f"{tokenizer} exists and other datasets there may use it: pass --tokenizer "
                              f"{tokenizer} to reuse it, or delete it to train a new one")
    train_tokenizer(read_documents(files, text_key), vocab_size, tokenizer)
    return tokenizer


def _refuse_other(out: Path) -> None:
    if Path(f"{out}.idx").exists():
        raise FileExistsError(f"{out}.idx exists and is made from other inputs or settings: delete {out}.bin, "
                              f"{out}.idx and {out}.json to rebuild it, or choose another --output-prefix")


def _join(out: Path, prefixes: list[Path], dtype, made_from: dict, keep: bool = True) -> dict:
    """The complete datasets ``prefixes`` joined in order into ``out``; returns the summed counts. Unless ``keep``,
    a single dataset is moved instead (no copy; megatron's ``add_index`` also runs a full ``gc.collect``, ~0.4 s)."""
    parts = [counts(p) for p in prefixes]
    total = {key: sum(c[key] for c in parts) for key in ("docs", "tokens", "bad")}
    total["max_id"] = max(c["max_id"] for c in parts)
    total["first_bad"] = next((c["first_bad"] for c in parts if c["first_bad"]), None)
    if total["docs"] == 0:
        raise ValueError(f"no documents for {out}: every input was empty")
    remove_temporaries(out)
    if len(prefixes) == 1 and not keep:
        write_record(out, made_from, total)
        move(prefixes[0], out)
        return total
    with DatasetWriter(out, dtype) as joined:
        for prefix in prefixes:
            joined.join(prefix)
        write_record(out, made_from, total)
    return total


def preprocess(inputs, output_prefix, tokenizer=None, vocab_size=None, text_key="text", pattern=None, workers=1,
               shard=None, part_mb=PART_MB, skip_bad=False, stream=None) -> dict:
    """Tokenize ``inputs`` into ``output_prefix.{bin,idx}`` with ``tokenizer`` (a tokenizer.json, copied beside the
    output), or with a new byte-level BPE of ``vocab_size`` trained on them and saved as ``tokenizer.json`` there;
    ``workers`` processes tokenize. ``shard`` "I/N" (default: the SLURM array task's, else the whole input) takes
    the I-th of N shares of the input and writes ``PREFIX-0000I-of-0000N``. Finished parts (``part_mb`` of input
    each) of an interrupted run are reused; a complete output made from the same inputs is returned as it is.
    Returns the output's counts."""
    shard, shards = parse_shard(shard)
    files = expand_inputs(inputs, pattern)
    if any(format_of(path) in ("jsonl.zst", "parquet") for path in files):
        require_extra("data", command="stem-preprocess")  # before any work, not at the first such file
    prefix = Path(output_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer_for(files, prefix, tokenizer, vocab_size, text_key, shards)
    files = [files[i] for i in shard_range([path.stat().st_size for path in files], shard, shards)]
    mine = plan_parts(files, int(part_mb * 2**20))
    out = shard_prefix(prefix, shard, shards)
    settings = {"tokenizer": hashlib.sha256(tokenizer.read_bytes()).hexdigest(), "text_key": text_key,
                "skip_bad": skip_bad}
    made_from = _made_from(mine, settings)
    summary = {"prefix": str(out), "files": len(made_from["files"]), "tokenizer": str(tokenizer)}
    if reusable(out, made_from):
        return {**summary, **counts(out), "reused": True}
    _refuse_other(out)
    hf = HFTokenizer(tokenizer)
    dtype = DType.optimal_dtype(hf.vocab_size)
    work = out.with_name(f"{out.name}.parts")
    work.mkdir(exist_ok=True)
    part_prefix = {part.index: work / f"part-{part.index:06d}" for part in mine}
    part_made_from = {part.index: _made_from([part], settings) for part in mine}
    todo = [part for part in mine if not reusable(part_prefix[part.index], part_made_from[part.index])]
    progress = Progress(sum(p.bytes for p in mine), sum(p.bytes for p in mine if p not in todo), stream)
    results = _encoded(_items(todo, text_key), workers, (str(tokenizer), hf.eod, dtype, text_key))
    try:
        for part in todo:
            _write_part(results, part_prefix[part.index], dtype, part_made_from[part.index], skip_bad, progress)
    finally:
        results.close()
        progress.close()
    total = _join(out, [part_prefix[part.index] for part in mine], dtype, made_from, keep=False)
    shutil.rmtree(work)
    return {**summary, **total, "seconds": progress.elapsed, "tokens_per_s": progress.tokens / progress.elapsed,
            "reused_parts": len(mine) - len(todo)}


def merge(output_prefix) -> dict:
    """The shards ``PREFIX-*-of-N`` of ``output_prefix``, all N complete, joined in order into ``PREFIX``: the bytes
    one process writes from the whole input. The shards stay (a blend can use them as they are)."""
    prefix = Path(output_prefix)
    found = sorted(prefix.parent.glob(f"{glob.escape(prefix.name)}-[0-9][0-9][0-9][0-9][0-9]-of-[0-9]*.idx"))
    shards = {int(p.stem.rsplit("-", 1)[1]) for p in found}
    if not found:
        raise FileNotFoundError(f"no shards {prefix}-NNNNN-of-NNNNN.idx to merge: run stem-preprocess --shard I/N "
                                f"--output-prefix {prefix} for each I first")
    if len(shards) > 1:
        raise ValueError(f"{prefix} has shards of {sorted(shards)} splits; keep those of one --shard N")
    (n,) = shards
    parts = [shard_prefix(prefix, i, n) for i in range(n)]
    missing = [str(p) for p in parts if not is_complete(p)]
    if missing:
        raise FileNotFoundError(f"{len(missing)} of {n} shards are not complete ({', '.join(missing[:3])}"
                                f"{' ...' if len(missing) > 3 else ''}): rerun their --shard I/{n} jobs, then merge")
    first = recorded_inputs(parts[0])
    made_from = {"shards": [p.name for p in parts], "tokenizer": first["tokenizer"], "text_key": first["text_key"]}
    if reusable(prefix, made_from):
        return {"prefix": str(prefix), **counts(prefix), "shards": n, "reused": True}
    _refuse_other(prefix)
    dtype = IndexedDataset(str(parts[0])).index.dtype
    return {"prefix": str(prefix), **_join(prefix, parts, dtype, made_from), "shards": n}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="stem-preprocess", description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", help="files or directories: .jsonl, .jsonl.gz, .jsonl.zst, .parquet "
                                                   "(records), any other file one document")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer", help="tokenizer.json to use (a Hugging Face model's, to start from it: "
                                            "checkpoint.init_from_hf); copied beside the output")
    parser.add_argument("--vocab-size", type=int, help="train a byte-level BPE of this size instead")
    parser.add_argument("--text-key", default="text", help="the jsonl field or parquet column holding the text")
    parser.add_argument("--pattern", help="files taken from input directories (glob; default: every file of the "
                                          "formats above and *.txt)")
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="tokenizing processes (default: the CPUs this job may use)")
    parser.add_argument("--shard", help="I/N: take the I-th of N shares of the input, write PREFIX-0000I-of-0000N "
                                        "(default: the SLURM array task's place, else the whole input)")
    parser.add_argument("--merge", action="store_true", help="join PREFIX's N complete shards into PREFIX")
    parser.add_argument("--part-mb", type=float, default=PART_MB,
                        help="input MB per resumable part (a rerun after a kill redoes the part in progress)")
    parser.add_argument("--skip-bad", action="store_true",
                        help="skip unreadable records and the damaged rest of a file, and count them, instead of "
                             "stopping at the first")
    args = parser.parse_args(argv)
    if args.merge == bool(args.input):
        parser.error("give --input (preprocess) or --merge (join shards), not both")
    if args.workers < 1:
        parser.error(f"--workers {args.workers}: give at least 1")
    try:
        if args.merge:
            stats = merge(args.output_prefix)
        else:
            stats = preprocess(args.input, args.output_prefix, args.tokenizer, args.vocab_size, args.text_key,
                               args.pattern, args.workers, args.shard, args.part_mb, args.skip_bad)
    except (ValueError, OSError) as e:
        parser.exit(2, f"stem-preprocess: error: {e}\n")
    except KeyboardInterrupt:
        parser.exit(130, "stem-preprocess: interrupted; the finished parts are kept: the same command continues\n")
    print(_summary(stats))


def _summary(stats: dict) -> str:
    """The job's last line: what was written (or found complete), from how much, and how fast."""
    source = f"{stats['shards']} shards" if "shards" in stats else f"{stats['files']} files"
    line = f"{stats['prefix']}: {stats['docs']:,} documents, {stats['tokens']:,} tokens from {source}"
    if stats.get("reused"):
        return f"{line} (complete already: delete it to rebuild)"
    if "seconds" in stats:
        earlier = f", {stats['reused_parts']} parts from an earlier run" if stats["reused_parts"] else ""
        line += f" in {stats['seconds']:.1f} s ({stats['tokens_per_s'] / 1e6:.2f}M tokens/s{earlier})"
    if stats["bad"]:
        line += f"; skipped {stats['bad']:,} bad records or damaged files (first: {stats['first_bad']})"
    return line


if __name__ == "__main__":
    main()
