"""Build the demo corpus: Python 3.11 documentation sources -> BPE tokenizer -> megatron indexed dataset.

The reST sources shipped by Debian's ``python3.11-doc`` are a real, license-clean, offline-available
~11 MB English/code corpus, which is enough for a small pretraining demo without network access.
"""

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

DEFAULT_SOURCE_DIR = "/usr/share/doc/python3.11/html/_sources"
APT_HINT = "apt-get update && apt-get install -y python3.11-doc"
EOD_TOKEN = "<|endoftext|>"


def collect_text(source_dir=DEFAULT_SOURCE_DIR):
    """Yield one document (file contents) per ``*.txt`` file under ``source_dir``, in sorted path order.

    Sorted order makes everything downstream (split, tokenizer, dataset) reproducible.
    """
    root = Path(source_dir)
    files = sorted(root.rglob("*.txt")) if root.is_dir() else []
    if not files:
        raise FileNotFoundError(
            f"no *.txt documentation sources under {root}; install them with `{APT_HINT}`"
        )
    for path in files:
        yield path.read_text(encoding="utf-8")


def train_tokenizer(docs, vocab_size, path):
    """Train a byte-level BPE tokenizer on ``docs`` and save it to ``path`` (tokenizer.json).

    Byte-level BPE never produces unknown tokens and decodes back to the exact input text.
    ``EOD_TOKEN`` is the first special token, so it gets id 0.
    """
    if vocab_size <= 256:
        raise ValueError(f"vocab_size {vocab_size} must exceed the 256-byte alphabet plus {EOD_TOKEN}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer=trainer)
    assert tokenizer.token_to_id(EOD_TOKEN) == 0
    tokenizer.save(str(path))
    return tokenizer


def build_indexed_dataset(docs, tokenizer, prefix):
    """Write ``prefix.bin``/``prefix.idx`` with one megatron document (tokens + EOD) per doc.

    Returns the number of tokens written. The dtype is the one megatron's own preprocessing picks
    for this vocabulary (uint16 below 65500 ids, else int32).
    """
    eod = tokenizer.token_to_id(EOD_TOKEN)
    builder = IndexedDatasetBuilder(
        f"{prefix}.bin", dtype=DType.optimal_dtype(tokenizer.get_vocab_size())
    )
    num_tokens = 0
    for doc in docs:
        ids = tokenizer.encode(doc).ids + [eod]
        builder.add_document(torch.tensor(ids), [len(ids)])
        num_tokens += len(ids)
    builder.finalize(f"{prefix}.idx")
    return num_tokens


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
    tokenizer = train_tokenizer(splits["train"], vocab_size, out / "tokenizer.json")
    info = {
        "settings": settings,
        "docs": {name: len(split) for name, split in splits.items()},
        "tokens": {name: build_indexed_dataset(split, tokenizer, out / name) for name, split in splits.items()},
        "tokenizer_vocab_size": tokenizer.get_vocab_size(),
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
