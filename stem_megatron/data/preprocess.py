"""``stem-preprocess``: documents (jsonl or plain text files) -> megatron-core indexed dataset (.bin/.idx).

Each document becomes one sequence followed by the EOD token, as megatron's own preprocessing writes
them; ``GPTDataset`` packs documents into fixed-length samples later. Without ``--tokenizer`` a
byte-level BPE is trained on the input first (``--vocab-size``) and saved next to the output.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from stem_megatron.data.tokenizer import HFTokenizer, train_tokenizer


def expand_inputs(inputs: Iterable, pattern: str = "*.txt") -> list[Path]:
    """Files named in ``inputs``, directories expanded to their ``pattern`` matches in sorted order.

    Sorted order makes the dataset (and a tokenizer trained on it) reproducible.
    """
    files = []
    for item in map(Path, inputs):
        if item.is_dir():
            files += sorted(p for p in item.rglob(pattern) if p.is_file())
        elif item.is_file():
            files.append(item)
        else:
            raise FileNotFoundError(f"input {item} does not exist")
    if not files:
        raise FileNotFoundError(f"no input files in {[str(i) for i in inputs]} (directories are searched "
                                f"for {pattern!r})")
    return files


def read_documents(files: Iterable[Path], text_key: str = "text") -> Iterator[str]:
    """Documents in order: one per non-blank line of a ``.jsonl`` file (its ``text_key`` field), one per other file."""
    for path in map(Path, files):
        if path.suffix != ".jsonl":
            try:
                yield path.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path} is not UTF-8 text ({e}); pass only text files or a --pattern that "
                                 f"excludes it") from None
            continue
        with path.open(encoding="utf-8") as lines:
            for lineno, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno} is not a JSON object ({e}); jsonl needs one per line") from None
                text = record.get(text_key) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ValueError(f"{path}:{lineno} has no string field {text_key!r} (found {keys}); "
                                     f"choose the field with --text-key")
                yield text


def write_indexed_dataset(docs: Iterable[str], tokenizer: HFTokenizer, prefix, batch_size: int = 256) -> dict:
    """Write ``prefix.bin``/``prefix.idx``: per document its tokens + EOD; returns doc and token counts.

    The dtype is the one megatron's preprocessing picks for the vocabulary (uint16 below 65500 ids).
    """
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(tokenizer.vocab_size))
    num_docs = num_tokens = 0
    docs = iter(docs)
    while batch := list(itertools.islice(docs, batch_size)):
        for ids in tokenizer.tokenize_batch(batch):
            ids.append(tokenizer.eod)
            builder.add_document(np.asarray(ids), [len(ids)])
            num_docs, num_tokens = num_docs + 1, num_tokens + len(ids)
    builder.finalize(f"{prefix}.idx")
    if num_docs == 0:
        raise ValueError(f"no documents for {prefix}: every input was empty")
    return {"docs": num_docs, "tokens": num_tokens}


def _beside(tokenizer: Path, data_dir: Path) -> Path:
    """``tokenizer`` copied into ``data_dir`` as its ``tokenizer.json`` (a run reads ``data.dir/tokenizer.json``: a
    Hugging Face model's, ``stem-preprocess --tokenizer MODEL_DIR/tokenizer.json``); one already there must be it."""
    if not tokenizer.is_file():
        raise FileNotFoundError(f"tokenizer {tokenizer} does not exist")
    there = data_dir / "tokenizer.json"
    if not there.exists():
        shutil.copyfile(tokenizer, there)
    elif there.read_bytes() != tokenizer.read_bytes():
        raise ValueError(f"{there} is another tokenizer than {tokenizer}: the datasets of one data dir share one "
                         f"tokenizer; write these to another directory")
    return there


def preprocess(inputs, output_prefix, tokenizer=None, vocab_size=None, text_key="text", pattern="*.txt") -> dict:
    """Tokenize ``inputs`` into ``output_prefix.{bin,idx}`` with ``tokenizer`` (a tokenizer.json, copied beside the
    output), or with a new byte-level BPE of ``vocab_size`` trained on them and saved as ``tokenizer.json`` there."""
    if (tokenizer is None) == (vocab_size is None):
        raise ValueError("give exactly one of --tokenizer (reuse a tokenizer.json) or --vocab-size (train one)")
    files = expand_inputs(inputs, pattern)
    prefix = Path(output_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        tokenizer = prefix.parent / "tokenizer.json"
        if tokenizer.exists():
            raise FileExistsError(f"{tokenizer} exists and other datasets there may use it: pass --tokenizer "
                                  f"{tokenizer} to reuse it, or delete it to train a new one")
        train_tokenizer(read_documents(files, text_key), vocab_size, tokenizer)
    else:
        tokenizer = _beside(Path(tokenizer), prefix.parent)
    stats = write_indexed_dataset(read_documents(files, text_key), HFTokenizer(tokenizer), prefix)
    return {**stats, "files": len(files), "tokenizer": str(tokenizer)}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="stem-preprocess", description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, help="jsonl / text files or directories")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer", help="tokenizer.json to use (a Hugging Face model's, to start from it: "
                                            "checkpoint.init_from_hf); copied beside the output")
    parser.add_argument("--vocab-size", type=int, help="train a byte-level BPE of this size instead")
    parser.add_argument("--text-key", default="text", help="field holding the text in jsonl records")
    parser.add_argument("--pattern", default="*.txt", help="files taken from input directories (glob)")
    args = parser.parse_args(argv)
    try:
        stats = preprocess(args.input, args.output_prefix, args.tokenizer, args.vocab_size, args.text_key, args.pattern)
    except (ValueError, OSError) as e:
        parser.exit(2, f"stem-preprocess: error: {e}\n")
    print(f"{args.output_prefix}: {stats['docs']} documents, {stats['tokens']:,} tokens from {stats['files']} "
          f"files (tokenizer {stats['tokenizer']})")


if __name__ == "__main__":
    main()
