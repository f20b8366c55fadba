"""Build the demo corpus: Python 3.11 documentation sources -> BPE tokenizer -> megatron indexed dataset.

The reST sources shipped by Debian's ``python3.11-doc`` are a real, license-clean, offline-available
~11 MB English/code corpus, which is enough for a small pretraining demo without network access.
This module only adds the train/valid document split and idempotence; tokenizer training and the
indexed dataset are ``stem-preprocess``'s functions.
"""

import argparse
import json
import os
from pathlib import Path

import numpy as np

from stem_megatron.data.documents import expand_inputs, read_documents
from stem_megatron.data.preprocess import write_indexed_dataset
from stem_megatron.data.tokenizer import HFTokenizer, train_tokenizer

DEFAULT_SOURCE_DIR = "/usr/share/doc/python3.11/html/_sources"
APT_HINT = "apt-get update && apt-get install -y python3.11-doc"


def collect_text(source_dir=DEFAULT_SOURCE_DIR):
    """One document (file contents) per ``*.txt`` file under ``source_dir``, in sorted path order."""
    try:
        files = expand_inputs([source_dir], "*.txt")
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e}; install the documentation sources with `{APT_HINT}`") from None
    return read_documents(files)


def _summary(out_dir, info, cached):
    docs, tokens = info["docs"], info["tokens"]
    return (
        f"corpus {out_dir}{' (cached)' if cached else ''}: {docs['train'] + docs['valid']} docs "
        f"({docs['train']} train / {docs['valid']} valid), {tokens['train']:,} train tokens, "
        f"{tokens['valid']:,} valid tokens, tokenizer vocab {info['tokenizer_vocab_size']}"
    )


def prepare_corpus(out_dir, vocab_size=4096, valid_fraction=0.02, seed=1234, source_dir=DEFAULT_SOURCE_DIR):
    """Create ``tokenizer.json``, ``train.{bin,idx}``, ``valid.{bin,idx}`` in ``out_dir``; return the stats dict.

    Idempotent: ``out_dir/READY`` (JSON of settings + stats) is written last and atomically, so its
    presence with identical settings means every artifact is complete and nothing is redone. Docs are
    split by a seeded permutation of the sorted file list; the tokenizer only sees the train split.
    """
    out = Path(out_dir)
    marker = out / "READY"
    settings = {
        "vocab_size": vocab_size,
        "valid_fraction": valid_fraction,
        "seed": seed,
        "source_dir": str(Path(source_dir).resolve()),
    }
    if marker.exists():
        info = json.loads(marker.read_text())
        if info["settings"] == settings:
            print(_summary(out, info, cached=True))
            return info
        marker.unlink()  # stale settings: never leave a marker describing half-rewritten files

    docs = list(collect_text(source_dir))
    if len(docs) < 2:
        raise ValueError(f"need at least 2 documents for a train/valid split, found {len(docs)}")
    order = np.random.default_rng(seed).permutation(len(docs))
    num_valid = min(len(docs) - 1, max(1, round(len(docs) * valid_fraction)))
    splits = {
        "train": [docs[i] for i in order[num_valid:]],
        "valid": [docs[i] for i in order[:num_valid]],
    }

    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(splits["train"], vocab_size, out / "tokenizer.json")
    tokenizer = HFTokenizer(out / "tokenizer.json")
    stats = {name: write_indexed_dataset(split, tokenizer, out / name) for name, split in splits.items()}
    info = {
        "settings": settings,
        "docs": {name: s["docs"] for name, s in stats.items()},
        "tokens": {name: s["tokens"] for name, s in stats.items()},
        "tokenizer_vocab_size": tokenizer.vocab_size,
    }
    tmp = out / "READY.tmp"
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, marker)
    print(_summary(out, info, cached=False))
    return info


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--source-dir", default=DEFAULT_SOURCE_DIR)
    args = parser.parse_args()
    prepare_corpus(args.out, vocab_size=args.vocab_size, source_dir=args.source_dir)


if __name__ == "__main__":
    main()
