"""Benchmarks and tools run by a Python without the project's environment, or on a missing corpus, stop with one
line naming `make setup` (stem_megatron/setup_check.py), not a traceback; a command run by a Python without the
extra it needs (lm-eval, matplotlib, ...) stops with one line naming the extra and how to install it."""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from stem_megatron import setup_check

ROOT = Path(__file__).resolve().parents[1]
# imported, never run; stdlib only: study_arms.py by study.py and study_report.py, process_tree.py by gpu_step.py and
# gpu_check.py, gpu_goals.py, gpu_plan.py and gpu_prechecks.py by gpu_check.py
LIBRARIES = {"study_arms.py", "process_tree.py", "gpu_goals.py", "gpu_plan.py", "gpu_prechecks.py"}
# run by any Python, they need no project venv: wheelhouse.py builds an offline node's wheelhouse where pip reaches an
# index; test_durations.py reads a JUnit XML; gpu_check.py runs its pre-checks and the setup first, then goes on under
# the venv's Python (which it checks then)
STANDALONE = {"wheelhouse.py", "test_durations.py", "gpu_check.py"}
SCRIPTS = sorted(p for p in [*ROOT.glob("benchmarks/*.py"), *ROOT.glob("tools/*.py")]
                 if p.name not in LIBRARIES | STANDALONE)
EXTRAS = {"eval": ["lm-eval"], "plots": ["matplotlib"], "dashboards": ["wandb-workspaces"],
          "slurm": ["hydra-submitit-launcher"], "hf": ["transformers", "accelerate"], "data": ["zstandard", "pyarrow"]}
# what the extras install, by the names of their site-packages entries (package, .dist-info)
EXTRA_ENTRIES = ("lm_eval", "matplotlib", "mpl_toolkits", "pylab", "wandb_workspaces", "hydra_submitit_launcher",
                 "transformers", "accelerate", "zstandard", "pyarrow")


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A fresh venv: the interpreter the project's venv was made from, none of its packages."""
    venv = tmp_path_factory.mktemp("bare")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv / "bin" / "python"


@pytest.fixture(scope="module")
def core_python(tmp_path_factory):
    """A fresh venv with this Python's packages but not the extras': its site-packages links every entry of this
    one's except what the extras install, so it lacks their modules and their metadata."""
    venv = tmp_path_factory.mktemp("core")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv)}))
    for entry in Path(sysconfig.get_path("purelib")).iterdir():
        if not entry.name.startswith(EXTRA_ENTRIES):
            (site / entry.name).symlink_to(entry)
    return venv / "bin" / "python"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_python_without_the_project_gets_the_fix(bare_python, script):
    """The arguments come back quoted in the command to rerun (wandb_dashboard.py checks after parsing them)."""
    relative = script.relative_to(ROOT)
    proc = subprocess.run([str(bare_python), str(relative), "--title", "a b"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert proc.stderr.startswith(f"{script.name}: this Python ({bare_python}) does not have "), proc.stderr
    assert proc.stderr.endswith(f": run `make setup`, then `.venv/bin/python {relative} --title 'a b'`\n"), proc.stderr
    assert len(proc.stderr.splitlines()) == 1


def test_from_elsewhere_the_fix_names_the_checkout(bare_python, tmp_path):
    proc = subprocess.run([str(bare_python), str(ROOT / "benchmarks" / "stem_host.py")], capture_output=True,
                          text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.endswith(f"run `make -C {ROOT} setup`, then `{ROOT}/.venv/bin/python "
                                f"{ROOT}/benchmarks/stem_host.py`\n"), proc.stderr


def test_the_projects_python_passes():
    proc = subprocess.run([sys.executable, "-c", "from stem_megatron.setup_check import environment_problem; "
                           "print(environment_problem())"], capture_output=True, text=True, timeout=60)
    assert proc.stdout == "None\n", proc.stderr


def test_a_missing_corpus_names_make_setup(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/study.py", "--data-dir", str(tmp_path / "absent")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2  # argparse's usage error
    assert (f"study.py: error: {tmp_path / 'absent'}/tokenizer.json is missing: `make setup` builds the demo corpus "
            "(data_cache/python-doc), `stem-preprocess` any other (README, Data)") in proc.stderr


def test_the_extras_come_from_the_projects_metadata():
    assert {extra: setup_check.required(extra) for extra in EXTRAS} == EXTRAS
    assert not {name for names in EXTRAS.values() for name in names} & set(setup_check.required())  # not core
    assert setup_check.extra_problem(*EXTRAS) is None  # the dev extra installs them all


@pytest.mark.parametrize("command, name, extras", [
    (["tools/plot_metrics.py", "runs/x"], "plot_metrics.py", ["plots"]),
    (["tools/capacity_scaling.py", "--data", "x"], "capacity_scaling.py", ["plots"]),
    (["tools/angular_spread.py", "--export", "x"], "angular_spread.py", ["plots"]),
    (["tools/wandb_dashboard.py", "--dry-run", "--viewspec"], "wandb_dashboard.py", ["dashboards"]),
    (["benchmarks/study_report.py"], "study_report.py", ["plots"]),
    (["benchmarks/study.py"], "study.py", ["slurm", "plots"]),
    (["-m", "stem_megatron.eval.cli", "--export", "x", "--out", "r.json", "--tasks", "paper"], "stem-eval", ["eval"]),
    (["-m", "stem_megatron.eval.cli", "--export", "x", "--out", "r.json", "--task-file", "t.yaml", "--niah",
      "--haystack", "h", "--niah-plot", "n.png"], "stem-eval", ["eval", "plots"]),
    (["-m", "stem_megatron.edit.cli", "--export", "x", "--source", "a", "--target", "b", "--prompt", "a",
      "--plot", "e.png"], "stem-edit", ["plots"]),
    (["-m", "stem_megatron.train", "-m", "hydra/launcher=slurm"], "stem-train", ["slurm"]),
    (["-m", "stem_megatron.export.hf.cli", "x", "y"], "stem-export-hf", ["hf"]),
], ids=["plot_metrics", "capacity_scaling", "angular_spread", "wandb_dashboard", "study_report", "study",
        "stem-eval tasks", "stem-eval tasks and figure", "stem-edit figure", "stem-train sweep on SLURM",
        "stem-export-hf"])
def test_a_command_without_its_extra_names_it(core_python, command, name, extras):
    """Before any work (the arguments name nothing that exists): one line naming the extras, their packages and
    the fix."""
    proc = subprocess.run([str(core_python), *command], capture_output=True, text=True, cwd=ROOT, timeout=120)
    named = " and ".join(f"'{extra}'" for extra in extras) + (" extras" if len(extras) > 1 else " extra")
    names = [name for extra in extras for name in EXTRAS[extra]]
    missing = " and ".join(names) + (" are" if len(names) > 1 else " is")
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert proc.stderr == (f"{name}: needs the {named} ({missing} not installed): run `make setup`, "
                           f"or `{core_python} -m pip install -e '.[{','.join(extras)}]'`\n")


def test_preprocessing_zst_without_the_data_extra_names_it_before_any_work(core_python, tmp_path):
    (tmp_path / "a.jsonl.zst").write_bytes(b"")
    proc = subprocess.run([str(core_python), "-m", "stem_megatron.data.preprocess", "--input", str(tmp_path),
                           "--output-prefix", str(tmp_path / "out" / "train"), "--tokenizer", "none.json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1 and proc.stdout == "" and not (tmp_path / "out").exists(), proc.stderr
    assert proc.stderr == ("stem-preprocess: needs the 'data' extra (zstandard and pyarrow are not installed): run "
                           f"`make setup`, or `{core_python} -m pip install -e '.[data]'`\n")


def test_from_elsewhere_the_extras_fix_names_the_checkout(core_python, tmp_path):
    proc = subprocess.run([str(core_python), str(ROOT / "tools" / "plot_metrics.py"), "x"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.endswith(f"run `make -C {ROOT} setup`, or `{core_python} -m pip install -e '{ROOT}[plots]'`\n")


def test_what_needs_no_extra_runs_without_them(core_python, tmp_path):
    """The dashboard's spec (--dry-run) is plain JSON; stem-eval's perplexity needs no lm-eval: it gets as far
    as the export."""
    proc = subprocess.run([str(core_python), "tools/wandb_dashboard.py", "--dry-run"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["dashboard"]["title"] == "STEM variants: loss, loss spikes, grad norm"
    proc = subprocess.run([str(core_python), "-m", "stem_megatron.eval.cli", "--export", str(tmp_path / "absent"),
                           "--out", str(tmp_path / "r.json"), "--ppl", "--data", "x"], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"stem-eval: error: export directory {tmp_path / 'absent'} does not exist"), \
        proc.stderr
