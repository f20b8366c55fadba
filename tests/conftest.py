"""Shared fixtures: a small synthetic corpus prepared by the real pipeline (tokenizer + indexed dataset).

The suite tests the CPU path on any machine: the GPUs are hidden from this process and every process it starts
(``CUDA_VISIBLE_DEVICES=""``, set before torch is imported), as ``stem-doctor``'s CPU job hides them, so a GPU node
runs the same CPU tests as CI. Tests marked ``gpu`` (``tests/test_gpu.py``) run where ``nvidia-smi`` lists a GPU,
in subprocesses given the machine's GPUs back (the ``gpu_env`` fixture); elsewhere they are deselected.
"""

import os
import random

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
_VISIBLE = os.environ.get("CUDA_VISIBLE_DEVICES")
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything imports torch

from stem_megatron.doctor.cuda import nvidia_smi_gpus  # noqa: E402 - after hiding the GPUs from torch

GPUS = nvidia_smi_gpus()  # the driver's list: nvidia-smi does not read CUDA_VISIBLE_DEVICES


def gpu_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess that uses the machine's GPUs (a ``gpu`` test's job)."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | extra
    if _VISIBLE is not None:
        env["CUDA_VISIBLE_DEVICES"] = _VISIBLE
    return env


@pytest.fixture(name="gpu_env")
def _gpu_env():
    return gpu_env


def pytest_collection_modifyitems(config, items):
    if GPUS:
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


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


@pytest.fixture(scope="session")
def runs(corpus, tmp_path_factory):
    """The session's finished training runs (``tests/runs.py``), shared by the tests that compare against them."""
    from runs import Runs

    return Runs(corpus, tmp_path_factory.mktemp("runs"))


@pytest.fixture(autouse=True)
def _own_rendezvous_env(monkeypatch):
    """A test that loads a model in the pytest process starts a world of one there, which sets MASTER_PORT and
    friends in os.environ; they are restored after each test so later tests' child processes (stem-eval,
    stem-flops, training jobs) start their own world instead of binding this process' port."""
    from stem_megatron.parallel import RENDEZVOUS_VARS

    for key in RENDEZVOUS_VARS:
        monkeypatch.delenv(key, raising=False)
