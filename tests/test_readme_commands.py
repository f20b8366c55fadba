"""Every command and benchmark README.md and docs/*.md name runs in the suite, at its smallest size: ``RUNS`` says which
test runs each, and the first test fails when the README or docs/ name one that no test runs (or a test named here is
gone). The commands that no other test ran run here: ``make demo``, ``benchmarks/memory_plan.py``,
``benchmarks/stem_host.py``, ``tools/prepare_midtrain_mix.sh`` and ``tools/test_durations.py``."""

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import VOCAB

ROOT = Path(__file__).resolve().parents[1]

# what the README or docs/ name -> (the file that runs it, the test there or None for a script, how that file spells
# it); a library a script imports (never run itself) -> that script, with None
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
    "benchmarks/lean_update.py": [("tests/test_lean_adam.py", "test_benchmark_at_its_smallest", "import lean_update")],
    "benchmarks/gpu_step.py": [("tests/test_gpu_step.py", "test_benchmark_records_every_variant_on_the_cpu",
                                '"gpu_step.py"')],
    "benchmarks/knowledge_edit.py": [("tests/test_study.py", "test_swapping_subject_rows_moves_the_fact",
                                      "from knowledge_edit import")],
    "benchmarks/memory_plan.py": [("tests/test_readme_commands.py", "test_memory_plan_benchmark_at_its_smallest",
                                   '"memory_plan.py"')],
    "benchmarks/study.py": [("tests/test_study.py", "test_study_runs_end_to_end_and_writes_its_report",
                             '"study.py"')],
    "benchmarks/conversion_study.py": [("tests/test_study.py",
                                        "test_conversion_study_runs_end_to_end_and_writes_its_section",
                                        '"conversion_study.py"')],
    "benchmarks/dataset_index.py": [("tests/test_dataset_index.py", "test_dataset_index_benchmark_at_its_smallest",
                                     "import dataset_index")],
    "tools/angular_spread.py": [("tests/test_analysis.py", "test_angular_spread_tool", '_tool("angular_spread")')],
    "tools/capacity_scaling.py": [("tests/test_analysis.py", "test_capacity_scaling_tool_on_corpus",
                                   '_tool("capacity_scaling")')],
    "tools/plot_metrics.py": [("tests/test_tracking.py", "test_plot_tool_writes_a_png", '_load_tool("plot_metrics")')],
    "tools/prepare_midtrain_mix.sh": [("tests/test_readme_commands.py",
                                       "test_prepare_midtrain_mix_builds_what_the_mix_recipe_reads",
                                       "prepare_midtrain_mix.sh")],
    # named in docs/
    "stem_megatron.flops": [("tests/test_flops.py", "test_cli_missing_field_exit_code",
                             '"-m", "stem_megatron.flops"')],
    "stem_megatron.torchrun": [("tests/test_preemption.py",
                                "test_a_signal_mid_run_saves_where_every_rank_agrees_and_the_rerun_redoes_no_step",
                                '"-m", "stem_megatron.torchrun"')],
    "benchmarks/exchange_overlap.py": [("tests/test_step_benchmarks.py",
                                        "test_exchange_overlap_runs_both_settings_on_two_nodes",
                                        '"exchange_overlap.py"')],
    "benchmarks/ffn_cost.py": [("tests/test_gpu_step.py", "test_make_bench_counts_two_thirds_of_the_ffn_flops",
                                '"benchmarks/ffn_cost.py"')],
    "benchmarks/process_tree.py": [("benchmarks/gpu_step.py", None, "from benchmarks.process_tree import"),
                                   ("tools/gpu_check.py", None, "from benchmarks.process_tree import")],
    "benchmarks/preprocess.py": [("tests/test_preprocess.py", "test_the_benchmark_at_its_smallest",
                                  '"preprocess.py"')],
    "benchmarks/row_sync.py": [("tests/test_row_sync.py", "test_emulated_nodes_measure_what_the_model_predicts",
                                '"benchmarks" / "row_sync.py"')],
    "benchmarks/sparse_layers.py": [("tests/test_sparse_layers.py", "test_two_rounds_count_every_collective",
                                     '"benchmarks/sparse_layers.py"')],
    "benchmarks/stem_host.py": [("tests/test_readme_commands.py", "test_stem_host_benchmark_at_a_small_size",
                                 '"stem_host.py"')],
    "benchmarks/study_report.py": [("benchmarks/study.py", None, "from study_report import write_report"),
                                   ("tests/test_study.py", "test_report_tables_from_fabricated_runs",
                                    "from study_report import write_report")],
    "tools/estimate_flops.py": [("tests/test_flops.py", "test_cli_qwen_json", '"tools" / "estimate_flops.py"')],
    "tools/gpu_check.py": [("tests/test_gpu_check.py", "test_gpu_check_refuses_a_machine_without_a_gpu",
                            '"tools" / "gpu_check.py"'),
                           ("tests/test_gpu_check.py",
                            "test_two_commands_in_one_lease_measure_everything_once_and_return_what_a_lease_can",
                            "gpu_check.main(")],
    "tools/gpu_goals.py": [("tools/gpu_check.py", None, "from tools.gpu_goals import")],
    "tools/golden_losses.py": [("tests/test_golden_losses.py", "test_check_refuses_without_a_gpu_in_one_line",
                                "golden.main(["),
                               ("tools/gpu_check.py", None, '"tools/golden_losses.py", "--check"')],
    "tools/gpu_plan.py": [("tools/gpu_check.py", None, "from tools.gpu_plan import")],
    "tools/gpu_prechecks.py": [("tests/test_gpu_check.py", "test_the_prechecks_name_what_the_node_lacks_and_its_fix",
                                "gpu_prechecks.checks(")],
    "tools/slurm_local.sh": [("tests/test_slurm.py", "test_pretrain_script_runs_tiny_cpu_job",  # its slurm fixture
                              '"tools" / "slurm_local.sh"')],
    "tools/test_durations.py": [("tests/test_readme_commands.py", "test_test_durations_writes_each_modules_seconds",
                                 '"test_durations.py"')],
    "tools/wandb_dashboard.py": [("tests/test_setup_check.py", "test_what_needs_no_extra_runs_without_them",
                                  '"tools/wandb_dashboard.py", "--dry-run"]')],
    "tools/wheelhouse.py": [("tests/test_offline_setup.py", "test_offline_setup_reuses_the_nodes_torch",
                             '"make", "--no-print-directory", "wheelhouse"'),
                            ("Makefile", None, "tools/wheelhouse.py")],
}


def readme_commands() -> set[str]:
    """The console scripts (``[project.scripts]`` of pyproject.toml: not a thread's name like ``stem-adam``, a
    variant's like ``stem-full`` or the project's), ``python -m`` modules, benchmarks, tools and make targets that the
    code of README.md and of every docs/*.md names."""
    scripts = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])
    text = "\n".join(path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    fenced = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    inline = re.findall(r"`([^`]+)`", re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S))
    names = set()
    for span in fenced + inline:
        names |= set(re.findall(r"(?<![\w/-])(stem(?:-[a-z]+)+)\b", span)) & scripts
        names |= set(re.findall(r"-m (stem_megatron[\w.]*)", span))
        names |= set(re.findall(r"\b((?:benchmarks|tools)/\w+\.(?:py|sh))\b", span))
        names |= {f"make {target}" for target in re.findall(r"\bmake ([a-z][a-z-]*)", span)}
    return names


def test_every_command_the_readme_names_has_a_test_that_runs_it():
    named = readme_commands()
    assert {"make demo", "make test", "stem-train", "benchmarks/memory_plan.py", "tools/plot_metrics.py",
            "benchmarks/exchange_overlap.py", "stem_megatron.torchrun"} <= named
    assert not {"stem-adam", "stem-full", "stem-megatron"} & named  # a thread, a variant, the project
    assert named - set(RUNS) == set(), ("README.md or docs/ name these, and no test runs them: add one and list it in "
                                        "RUNS")
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


# benchmarks/stem_host.py has no size flags: its main with its measurements' sizes (their defaults) small, 2 rounds
STEM_HOST_SMALL = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("stem_host", sys.argv[1])
host = importlib.util.module_from_spec(spec)
spec.loader.exec_module(host)
host.ADAM_ROUNDS = 2
host.rounds_side_by_side.__defaults__ = host.side_by_side.__defaults__ = (2,)
host.gather_vs_memcpy.__defaults__ = host.adam_costs.__defaults__ = (512, 64, 48)  # vocab, cols, touched rows
host.step_time.__defaults__ = (2,)
sys.argv = ["stem_host.py", "--json"]
host.main()
"""


@pytest.mark.slow
def test_stem_host_benchmark_at_a_small_size():
    """``benchmarks/stem_host.py --json`` in a process of its own, at tables of 512 x 64 with 48 rows touched, 2
    rounds and 2 training steps: its three comparisons, each with every side measured."""
    result = json.loads(_run([sys.executable, "-c", STEM_HOST_SMALL, str(ROOT / "benchmarks" / "stem_host.py")]))
    assert set(result) == {"gather", "adam", "step"}
    gather, adam, step = result["gather"], result["adam"], result["step"]
    assert gather["bytes"] == 48 * 64 * 4 and gather["gather_GBps"] > 0 and gather["memcpy_GBps"] > 0
    assert set(adam["seconds"]) == {"lazy_rows", "lazy_rows_4x_vocab", "lazy_rows_4x_vocab_spread", "dense_table",
                                    "dense_table_4x_vocab", "kernel_contiguous_rows", "memcpy_touched_bytes",
                                    "torch_sparse_adam"}
    assert all(t > 0 for t in adam["seconds"].values())
    assert (adam["unique"], adam["vocab"], adam["cols"], adam["rounds"]) == (48, 512, 64, 2)
    assert set(step["seconds"]) == {"device", "host"} and all(t > 0 for t in step["seconds"].values())
    assert step["host_vs_device"] == step["seconds"]["host"] / step["seconds"]["device"]


def test_test_durations_writes_each_modules_seconds(tmp_path, monkeypatch, capsys):
    """``tools/test_durations.py``'s main, loaded from the script (its file beside the test, not over
    tests/durations.json), on a JUnit XML of two modules: each module's seconds summed, the longest first."""
    spec = importlib.util.spec_from_file_location("durations_tool", ROOT / "tools" / "test_durations.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    junit = tmp_path / "suite.xml"
    junit.write_text('<testsuites><testsuite name="pytest">'
                     '<testcase classname="tests.test_a" name="test_x" time="1.5"/>'
                     '<testcase classname="tests.test_a" name="test_y" time="2.0"/>'
                     '<testcase classname="tests.test_b" name="test_z" time="10.4"/>'
                     '</testsuite></testsuites>')
    monkeypatch.setattr(tool, "OUT", tmp_path / "durations.json")
    monkeypatch.setattr(sys, "argv", ["test_durations.py", str(junit)])
    tool.main()
    written = (tmp_path / "durations.json").read_text()
    assert list(json.loads(written).items()) == [("tests/test_b.py", 10.4), ("tests/test_a.py", 3.5)]
    assert capsys.readouterr().out == f"wrote {tmp_path / 'durations.json'}: 2 modules, 14 s\n"
