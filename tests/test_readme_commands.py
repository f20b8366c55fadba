"""Every command and benchmark the README names runs in the suite, at its smallest size: ``RUNS`` says which test
runs each, and the first test fails when the README names one that no test runs (or a test named here is gone).
The README's commands that no other test ran run here: ``make demo``, ``benchmarks/memory_plan.py`` and
``tools/prepare_midtrain_mix.sh``."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import VOCAB

ROOT = Path(__file__).resolve().parents[1]

# what the README names -> (the file that runs it, the test there or None for a script, how that file spells it)
RUNS = {
    "make demo": [("tests/test_readme_commands.py", "test_make_demo_trains_at_its_smallest", '"demo"')],
    "make test": [(".ci/run", None, "make test")],  # the suite itself, as CI runs it
    "make test-quick": [("tests/test_readme_commands.py", "test_make_test_quick_is_the_fast_tests_and_the_quick_picks",
                         '"test-quick"')],
    "make setup": [(".ci/run", None, "make test")],  # `make test` sets up first
    "tools/setup.sh": [("tests/test_offline_setup.py", "test_offline_setup_reuses_the_nodes_torch", "tools/setup.sh")],
    "make wheelhouse": [("tests/test_offline_setup.py", "test_offline_setup_reuses_the_nodes_torch",
                         '"wheelhouse"')],
    "make gpu-check": [("tests/test_gpu_check.py", "test_gpu_check_refuses_a_machine_without_a_gpu", "gpu_check.py")],
    "stem-train": [("tests/test_preemption.py",
                    "test_a_signal_mid_run_saves_where_every_rank_agrees_and_the_rerun_redoes_no_step",
                    "stem_megatron.train"),
                   ("tests/test_run_dirs.py", "test_a_sweep_after_the_demo_starts_every_job_from_step_one",
                    '"-m", "stem.ratio=1/3,full"')],
    "stem_megatron.train": [("tests/test_preemption.py",
                             "test_a_signal_mid_run_saves_where_every_rank_agrees_and_the_rerun_redoes_no_step",
                             "stem_megatron.train")],
    "stem-doctor": [("tests/test_doctor.py", "test_doctor_passes_here_with_gpu_items_skipped",
                     "stem_megatron.doctor.cli")],
    "stem-edit": [("tests/test_edit.py", "test_swap_moves_stem_mlp_outputs_and_cli", "stem_megatron.edit.cli")],
    "stem-eval": [("tests/test_eval.py", "test_stem_eval_cli_end_to_end", "stem_megatron.eval.cli")],
    "stem-flops": [("tests/test_memory_plan.py", "test_cli_prints_the_plan_of_a_recipe", "stem_megatron.flops.cli"),
                   ("tests/test_flops.py", "test_cli_qwen_json", "estimate_flops.py")],
    "stem-generate": [("tests/test_generate.py", "test_stem_generate_cli_end_to_end", "stem_megatron.inference.cli")],
    "stem-export-hf": [("tests/test_hf_export.py", "test_a_tp2_pp2_run_exports_to_transformers_and_lm_eval",
                        "stem_megatron.export.hf.cli")],
    "stem-preprocess": [("tests/test_data_pipeline.py", "test_preprocess_to_packed_samples_round_trip",
                         "stem_megatron.data.preprocess")],
    "benchmarks/fetch_gather.py": [("tests/test_step_benchmarks.py",
                                    "test_fetch_gather_compares_both_gathers_on_equal_bytes", "fetch_gather.py")],
    "benchmarks/stem_layer.py": [("tests/test_step_benchmarks.py", "test_stem_layer_times_dense_and_both_stem_paths",
                                  "stem_layer.py")],
    "benchmarks/update_order.py": [("tests/test_step_benchmarks.py",
                                    "test_update_order_reports_both_optimizers_in_both_orders_and_the_working_set",
                                    "update_order.py")],
    "benchmarks/gpu_step.py": [("tests/test_gpu_step.py", "test_benchmark_records_every_variant_on_the_cpu",
                                '"gpu_step.py"')],
    "benchmarks/knowledge_edit.py": [("tests/test_study.py", "test_swapping_subject_rows_moves_the_fact",
                                      "from knowledge_edit import")],
    "benchmarks/memory_plan.py": [("tests/test_readme_commands.py", "test_memory_plan_benchmark_at_its_smallest",
                                   '"memory_plan.py"')],
    "benchmarks/study.py": [("tests/test_study.py", "test_study_runs_end_to_end_and_writes_its_report",
                             '"study.py"')],
    "tools/angular_spread.py": [("tests/test_analysis.py", "test_angular_spread_tool", '_tool("angular_spread")')],
    "tools/capacity_scaling.py": [("tests/test_analysis.py", "test_capacity_scaling_tool_on_corpus",
                                   '_tool("capacity_scaling")')],
    "tools/plot_metrics.py": [("tests/test_tracking.py", "test_plot_tool_writes_a_png", '_load_tool("plot_metrics")')],
    "tools/prepare_midtrain_mix.sh": [("tests/test_readme_commands.py",
                                       "test_prepare_midtrain_mix_builds_what_the_mix_recipe_reads",
                                       "prepare_midtrain_mix.sh")],
}


def readme_commands() -> set[str]:
    """The console scripts, ``python -m`` modules, benchmarks, tools and make targets the README's code names, and
    docs/running.md's (the README's detail)."""
    text = "\n".join((ROOT / name).read_text() for name in ("README.md", "docs/running.md"))
    fenced = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    inline = re.findall(r"`([^`]+)`", re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S))
    names = set()
    for span in fenced + inline:
        names |= set(re.findall(r"(?<![\w/-])(stem(?:-[a-z]+)+)\b", span))
        names |= set(re.findall(r"-m (stem_megatron[\w.]*)", span))
        names |= set(re.findall(r"\b((?:benchmarks|tools)/\w+\.(?:py|sh))\b", span))
        names |= {f"make {target}" for target in re.findall(r"\bmake ([a-z][a-z-]*)", span)}
    return names


def test_every_command_the_readme_names_has_a_test_that_runs_it():
    named = readme_commands()
    assert {"make demo", "make test", "stem-train", "benchmarks/memory_plan.py", "tools/plot_metrics.py"} <= named
    assert named - set(RUNS) == set(), "the README names these, and no test runs them: add one and list it in RUNS"
    for command, runs in RUNS.items():
        for path, test, spelling in runs:
            source = (ROOT / path).read_text()
            assert spelling in source, f"{command}: {path} does not run it (no {spelling!r})"
            if test is not None:
                tests = {node.name for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}
                assert test in tests, f"{command}: {path} has no test {test}"


def test_make_test_quick_is_the_fast_tests_and_the_quick_picks():
    """``make test-quick`` (a subset of the suite, which runs it whole) selects every test not marked slow and the
    picks tests/conftest.py names, each of which is still collected under its name."""
    from conftest import QUICK

    command = _run(["make", "--no-print-directory", "-n", "-o", "setup", "test-quick"])
    assert "-m pytest" in command and '-m "not slow or quick"' in command, command
    files = sorted({f"tests/{nodeid.split('::')[0]}" for nodeid in QUICK.values()})
    listed = _run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "quick", "-p", "no:cacheprovider",
                   *files])
    assert {line for line in listed.splitlines() if "::" in line} == {f"tests/{n}" for n in QUICK.values()}


def _run(cmd, **kwargs):
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900, **kwargs)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_make_demo_trains_at_its_smallest(corpus, tmp_path):
    """The README's first command, through make (its ``setup`` prerequisite already met: the suite runs after it),
    at 2 layers and 3 steps: the run's start block, three step lines and its checkpoint."""
    args = (f"model.num_layers=2 model.seq_length=32 model.vocab_size={VOCAB} data.vocab_size={VOCAB} "
            f"data.dir={corpus} train.steps=3 train.micro_batch_size=2 train.global_batch_size=4 out_dir={tmp_path}")
    out = _run(["make", "--no-print-directory", "-o", "setup", "demo", f"ARGS={args}"])
    assert "layout: 1 node(s) x 2 CPU rank(s), TP=2 PP=1 DP=1" in out
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000003"


@pytest.mark.slow
def test_memory_plan_benchmark_at_its_smallest(corpus, tmp_path):
    """``benchmarks/memory_plan.py`` on one rank of a 3-layer model (one STEM layer): the plan and the measured
    peaks side by side."""
    report = tmp_path / "memory.json"
    _run([sys.executable, str(ROOT / "benchmarks" / "memory_plan.py"), "--nproc", "1", "--json", str(report),
          "parallel=single", "model.num_layers=3", "model.seq_length=32", f"model.vocab_size={VOCAB}",
          f"data.vocab_size={VOCAB}", f"data.dir={corpus}", "train.micro_batch_size=2", "train.global_batch_size=2"])
    rows = {row["what"]: row for row in json.loads(report.read_text())["rows"]}
    node = rows["node total"]
    assert node["plan"] > 0 and node["measured"] > 0 and node["ratio"] == node["measured"] / node["plan"]
    shared = rows["shared memory (the run's files)"]  # the host table, mapped from /dev/shm
    assert shared["plan"] > 0 and shared["measured"] > 0


@pytest.mark.slow
def test_prepare_midtrain_mix_builds_what_the_mix_recipe_reads(corpus, tmp_path):
    """``bash tools/prepare_midtrain_mix.sh`` beside a scratch corpus' tokenizer: the two stand-ins
    ``data=midtrain_mix`` blends in, as megatron indexed datasets with documents in them."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from stem_megatron.recipes import compose_run

    shutil.copy(corpus / "tokenizer.json", tmp_path)
    _run(["bash", "tools/prepare_midtrain_mix.sh"], env={**os.environ, "DATA": str(tmp_path)})
    blend = compose_run(["data=midtrain_mix"]).data.blend
    for name in ("stdlib-numeric", "stdlib-code"):
        assert any(name in str(part) for part in blend), blend
        assert len(IndexedDataset(str(tmp_path / name))) > 0
