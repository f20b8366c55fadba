"""Tests for the demo corpus (tokenizer, indexed dataset, prepare_corpus) and the token-id check.
Sampling over megatron's datasets is tested in test_data_pipeline.py."""

import json

import numpy as np
import pytest
import torch
from conftest import VOCAB
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tokenizers import Tokenizer

from stem_megatron.data.corpus import DEFAULT_SOURCE_DIR, collect_text, prepare_corpus
from stem_megatron.data.integrity import check_token_ids
from stem_megatron.data.preprocess import write_indexed_dataset
from stem_megatron.data.tokenizer import HFTokenizer, train_tokenizer


def test_collect_text_missing_dir_names_apt_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install -y python3.11-doc"):
        next(collect_text(tmp_path / "absent"))


def test_tokenizer_round_trip_and_determinism(source_dir, tmp_path):
    docs = list(collect_text(source_dir))
    tok = train_tokenizer(docs, VOCAB, tmp_path / "a.json")
    train_tokenizer(docs, VOCAB, tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert tok.token_to_id("<|endoftext|>") == 0
    for text in docs + ["unseen: Ω ≠ ∞\n\ttabs  and  spaces "]:
        assert tok.decode(tok.encode(text).ids) == text


def test_indexed_dataset_round_trip(source_dir, tmp_path):
    docs = list(collect_text(source_dir))
    train_tokenizer(docs, VOCAB, tmp_path / "tokenizer.json")
    tok = HFTokenizer(tmp_path / "tokenizer.json")
    stats = write_indexed_dataset(docs, tok, tmp_path / "ds", batch_size=5)  # batches split the docs unevenly
    dataset = IndexedDataset(str(tmp_path / "ds"))
    assert dataset.index.dtype == np.uint16
    assert len(dataset) == stats["docs"] == len(docs)
    assert stats["tokens"] == sum(len(dataset[i]) for i in range(len(docs)))
    for i, doc in enumerate(docs):
        assert dataset[i].tolist() == tok.tokenize(doc) + [0]


def test_prepare_corpus_outputs_and_idempotence(corpus, source_dir):
    info = json.loads((corpus / "READY").read_text())
    assert info["docs"] == {"train": 10, "valid": 2}
    files = ["tokenizer.json", "train.bin", "train.idx", "valid.bin", "valid.idx", "READY"]
    mtimes = {f: (corpus / f).stat().st_mtime_ns for f in files}
    again = prepare_corpus(corpus, vocab_size=VOCAB, valid_fraction=0.2, source_dir=source_dir)
    assert again == info
    assert {f: (corpus / f).stat().st_mtime_ns for f in files} == mtimes


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 7, -1])
def test_check_token_ids_rejects_out_of_range(bad):
    tokens = torch.arange(10) % VOCAB
    check_token_ids(tokens, VOCAB)
    check_token_ids(tokens.numpy().astype(np.uint16), VOCAB)
    tokens[6] = bad
    with pytest.raises(ValueError, match=rf"token id {bad} at position 6 .*vocab_size {VOCAB}"):
        check_token_ids(tokens, VOCAB)
    with pytest.raises(ValueError, match=r"position \(1, 1\)"):
        check_token_ids(tokens.view(2, 5), VOCAB)


@pytest.mark.slow
def test_prepare_real_python_docs(tmp_path):
    """Full pipeline on python3.11-doc. A missing package must fail (collect_text names the apt command), not skip."""
    info = prepare_corpus(tmp_path, source_dir=DEFAULT_SOURCE_DIR)
    assert info["docs"]["train"] > 400 and info["docs"]["valid"] >= 5
    assert info["tokens"]["train"] > 1_000_000
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 4096
    valid = IndexedDataset(str(tmp_path / "valid"))
    assert sum(len(valid[i]) for i in range(len(valid))) == info["tokens"]["valid"]
