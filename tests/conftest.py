"""Shared fixtures: a small synthetic corpus prepared by the real pipeline (tokenizer + indexed dataset)."""

import os
import random

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

VOCAB = 400
WORDS = "the heap queue sorts tuples by key; def f(x): return x ** 2 # comment über naïve".split()


@pytest.fixture(scope="session")
def source_dir(tmp_path_factory):
    """Twelve synthetic reST-ish files (~300 lines total) standing in for the python docs."""
    root = tmp_path_factory.mktemp("sources")
    rng = random.Random(0)
    for i in range(12):
        lines = [f"Section {i}\n{'=' * 10}\n"]
        lines += [" ".join(rng.choices(WORDS, k=rng.randint(3, 12))) for _ in range(25)]
        (root / f"doc{i:02d}.rst.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def corpus(source_dir, tmp_path_factory):
    from stem_megatron.data.corpus import prepare_corpus

    out = tmp_path_factory.mktemp("corpus")
    prepare_corpus(out, vocab_size=VOCAB, valid_fraction=0.2, source_dir=source_dir)
    return out


@pytest.fixture(autouse=True)
def _own_rendezvous_env(monkeypatch):
    """A test that loads a model in the pytest process starts a world of one there, which sets MASTER_PORT and
    friends in os.environ; they are restored after each test so later tests' child processes (stem-eval,
    stem-flops, training jobs) start their own world instead of binding this process' port."""
    from stem_megatron.parallel import RENDEZVOUS_VARS

    for key in RENDEZVOUS_VARS:
        monkeypatch.delenv(key, raising=False)
