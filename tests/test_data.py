"""Tests for the demo data pipeline (corpus preparation, token windows, DP micro-batching)."""

import json

import numpy as np
import pytest
import torch
from conftest import VOCAB
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tokenizers import Tokenizer

from stem_megatron.data.batches import TokenWindows, check_token_ids, micro_batches
from stem_megatron.data.corpus import (
    DEFAULT_SOURCE_DIR,
    build_indexed_dataset,
    collect_text,
    prepare_corpus,
    train_tokenizer,
)


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
    tok = train_tokenizer(docs, VOCAB, tmp_path / "tokenizer.json")
    num_tokens = build_indexed_dataset(docs, tok, tmp_path / "ds")
    dataset = IndexedDataset(str(tmp_path / "ds"))
    assert dataset.index.dtype == np.uint16
    assert len(dataset) == len(docs)
    assert num_tokens == sum(len(dataset[i]) for i in range(len(docs)))
    for i, doc in enumerate(docs):
        assert dataset[i].tolist() == tok.encode(doc).ids + [0]


def test_prepare_corpus_outputs_and_idempotence(corpus, source_dir):
    info = json.loads((corpus / "READY").read_text())
    assert info["docs"] == {"train": 10, "valid": 2}
    files = ["tokenizer.json", "train.bin", "train.idx", "valid.bin", "valid.idx", "READY"]
    mtimes = {f: (corpus / f).stat().st_mtime_ns for f in files}
    again = prepare_corpus(corpus, vocab_size=VOCAB, valid_fraction=0.2, source_dir=source_dir)
    assert again == info
    assert {f: (corpus / f).stat().st_mtime_ns for f in files} == mtimes


def test_windows_shift_and_cover_stream(corpus):
    windows = TokenWindows(corpus / "train", seq_length=16, vocab_size=VOCAB)
    dataset = IndexedDataset(str(corpus / "train"))
    stream = np.concatenate([dataset[i] for i in range(len(dataset))]).astype(np.int64)
    assert windows.num_windows == (len(stream) - 1) // 16
    for i in range(windows.num_windows):
        assert windows.window(i).tolist() == stream[i * 16 : i * 16 + 17].tolist()
    batch = next(micro_batches(windows, 4, dp_rank=0, dp_size=1, seed=7))
    assert batch["tokens"].shape == batch["labels"].shape == (4, 16)
    assert batch["tokens"].dtype == batch["labels"].dtype == torch.int64
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


@pytest.mark.parametrize("num_micro_batches", [1, 3])
def test_dp_split_matches_single_rank(corpus, num_micro_batches):
    """DP=2 with micro batch b sees exactly DP=1 with micro batch 2b, split in halves, across epochs."""
    windows = TokenWindows(corpus / "train", seq_length=8, vocab_size=VOCAB)
    steps = 2 * windows.num_windows // (4 * num_micro_batches) + 1  # crosses epoch boundaries
    n = steps * num_micro_batches
    single = _take(micro_batches(windows, 4, 0, 1, num_micro_batches=num_micro_batches, seed=3), n)
    ranks = [_take(micro_batches(windows, 2, r, 2, num_micro_batches=num_micro_batches, seed=3), n) for r in (0, 1)]
    for whole, half0, half1 in zip(single, *ranks):
        for key in ("tokens", "labels"):
            assert torch.equal(whole[key], torch.cat([half0[key], half1[key]]))


def test_sampling_order_is_the_documented_permutation(corpus):
    windows = TokenWindows(corpus / "train", seq_length=8, vocab_size=VOCAB)
    n, gb = windows.num_windows, 6
    perm = np.concatenate([np.random.default_rng((5, e)).permutation(n) for e in range(3)])
    batches = _take(micro_batches(windows, gb, 0, 1, seed=5), 2 * n // gb)
    for g, batch in enumerate(batches):
        expected = torch.stack([windows.window(int(i))[:-1] for i in perm[g * gb : (g + 1) * gb]])
        assert torch.equal(batch["tokens"], expected)
    assert sorted(perm[:n].tolist()) == list(range(n))  # each epoch visits every window once


def test_determinism_resume_and_seed(corpus):
    windows = TokenWindows(corpus / "train", seq_length=8, vocab_size=VOCAB)
    run = _take(micro_batches(windows, 2, 1, 2, num_micro_batches=2, seed=11), 10)
    again = _take(micro_batches(windows, 2, 1, 2, num_micro_batches=2, seed=11), 10)
    resumed = _take(micro_batches(windows, 2, 1, 2, start_step=3, num_micro_batches=2, seed=11), 4)
    other_seed = _take(micro_batches(windows, 2, 1, 2, num_micro_batches=2, seed=12), 10)
    stack = lambda batches: torch.stack([b["tokens"] for b in batches])  # noqa: E731
    assert torch.equal(stack(run), stack(again))
    assert torch.equal(stack(run[6:]), stack(resumed))
    assert not torch.equal(stack(run), stack(other_seed))


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


def test_windows_reject_model_vocab_smaller_than_tokenizer(corpus):
    with pytest.raises(ValueError, match="vocab_size 100"):
        TokenWindows(corpus / "train", seq_length=8, vocab_size=100)


@pytest.mark.slow
def test_prepare_real_python_docs(tmp_path):
    """Full pipeline on python3.11-doc. A missing package must fail (collect_text names the apt command), not skip."""
    info = prepare_corpus(tmp_path, source_dir=DEFAULT_SOURCE_DIR)
    assert info["docs"]["train"] > 400 and info["docs"]["valid"] >= 5
    assert info["tokens"]["train"] > 1_000_000
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 4096
    windows = TokenWindows(tmp_path / "valid", seq_length=256, vocab_size=4096)
    assert windows.num_windows == (info["tokens"]["valid"] - 1) // 256
