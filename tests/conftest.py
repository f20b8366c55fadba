"""Shared fixtures: a small synthetic corpus prepared by the real pipeline (tokenizer + indexed dataset).

The suite tests the CPU path on any machine: the GPUs are hidden from this process and every process it starts
(``CUDA_VISIBLE_DEVICES=""``, set before torch is imported), as ``stem-doctor``'s CPU job hides them, so a GPU node
runs the same CPU tests as CI. Tests marked ``gpu`` (``tests/test_gpu.py``) run where ``nvidia-smi`` lists a GPU,
in subprocesses given the machine's GPUs back (the ``gpu_env`` fixture); elsewhere they are deselected.
"""

import json
import os
import random
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
_VISIBLE = os.environ.get("CUDA_VISIBLE_DEVICES")
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything imports torch

from stem_megatron.doctor.nvidia_smi import nvidia_smi_gpus  # noqa: E402 - after hiding the GPUs from torch

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


# `make test-quick` runs every test not marked slow and these, one small multi-process case a subsystem (marked quick
# here; tests/test_layout.py checks that each is still there)
QUICK = {
    "the STEM FFNs against the paper's formulas, TP=2": "test_mlp_variants.py::test_mlp_variants_match_paper_formulas[2]",
    "TP x PP against one process": "test_parallel_equivalence.py::test_layout_matches_single_process[tp2_pp2]",
    "Hash-MoE over EP=2": "test_parallel_equivalence.py::test_layout_matches_single_process[hash_moe_ep2]",
    "host tables against the device table": "test_host_store.py::test_host_store_trains_like_device_table[tp2-scaled]",
    "owner nodes against one table": "test_row_ownership.py::test_owner_nodes_train_like_one_table[2 nodes x 2 peers]",
    "the working set against the host step": "test_working_set.py::test_working_set_trains_bitwise_like_the_host_step"
                                             "[tp2-lazy]",
    "two nodes against one": "test_multinode.py::test_nodes_train_as_one[dp2-2-1-lazy]",
    "resume against the straight run": "test_checkpoint.py::test_resume_equals_straight_run[tp2-host-3]",
    "a damaged checkpoint": "test_checkpoint.py::test_damaged_checkpoint_is_reported_and_not_loaded[flip-in-process]",
    "a signal, a save, a rerun": "test_preemption.py::test_a_signal_mid_run_saves_where_every_rank_agrees_and_the_rerun"
                                 "_redoes_no_step[single-1-1-15-process]",
    "separate clipping, TP=2": "test_stem_clip.py::test_separate_clips_tables_and_dense_by_their_own_norms[tp2]",
    "two prefetchers' rows": "test_gpu_paths.py::test_two_prefetchers_at_once_deliver_the_host_rows_exactly",
    "the memory plan against what a node maps": "test_memory_plan.py::test_plan_is_what_each_node_maps_and_each_rank"
                                                "_builds[2-2-1-fp32]",
    "datasets alike on every rank": "test_data_pipeline.py::test_ranks_build_identical_datasets_from_one_cache",
    "SDPA attention over PP=2": "test_sdpa_attention.py::test_pipeline_parallel_losses_equal",
    "the export in transformers": "test_hf_export.py::test_transformers_runs_every_variant_as_stem_generate_does",
    "a Hugging Face model imported at TP=2 x PP=2":
        "test_hf_import.py::test_imported_models_give_transformers_logits_at_tp1_and_tp2_pp2",
    "generation with host rows": "test_generate.py::test_kv_cache_and_host_rows_equal_reference",
    "a row swap and its undo": "test_edit.py::test_swap_moves_stem_mlp_outputs_and_cli",
    "lm-eval's adapter": "test_eval.py::test_adapter_equals_model_log_softmax",
}
DURATIONS = Path(__file__).with_name("durations.json")  # each module's seconds in a full run: tools/test_durations.py


def pytest_collection_modifyitems(config, items):
    """The modules longest first, by their recorded seconds (unknown ones last), each module's tests in their order:
    ``make test``'s two workers (pytest-xdist, a module each at a time) then end together. The gpu tests, where
    nvidia-smi lists no GPU, are deselected."""
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    rank = {}
    for item in items:
        rank.setdefault(item.nodeid.split("::")[0], len(rank))
    items.sort(key=lambda item: (-seconds.get(item.nodeid.split("::")[0], 0.0), rank[item.nodeid.split("::")[0]]))
    quick = {f"tests/{nodeid}" for nodeid in QUICK.values()}
    for item in items:
        if item.nodeid in quick:
            item.add_marker(pytest.mark.quick)
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


@pytest.fixture(autouse=True, scope="module")
def _no_world_left_behind():
    """A module that loads a model in the pytest process (``InferenceModel``) starts a world of one there and keeps it:
    it ends with the module, so the next module on this worker starts without one, whatever ran before it."""
    yield
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_initialized():
            from stem_megatron import parallel

            parallel.destroy()


@pytest.fixture
def world_of_one():
    """A one-rank gloo world in the pytest process, for code that asks its rank or issues a collective (no port, no
    process); ended with the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _own_rendezvous_env(monkeypatch):
    """A test that loads a model in the pytest process starts a world of one there, which sets MASTER_PORT and
    friends in os.environ; they are restored after each test so later tests' child processes (stem-eval,
    stem-flops, training jobs) start their own world instead of binding this process' port."""
    from stem_megatron.parallel import RENDEZVOUS_VARS

    for key in RENDEZVOUS_VARS:
        monkeypatch.delenv(key, raising=False)
