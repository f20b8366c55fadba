"""`make setup` on a GPU node without a package registry (docs/gpu.md, Offline GPU nodes), end to end here.

A Python 3.12 venv stands for the node's /opt/torch/.venv: this venv's torch and the example node's other packages
(numpy, tokenizers, einops, pytest, ninja), with everything they require, linked into it, so no torch is downloaded.
Its freeze tells ``tools/wheelhouse.py`` what the node has; the wheelhouse is built from PyPI; then
``tools/setup.sh`` installs from it with pip offline: ``PIP_NO_INDEX`` and no pip configuration at all, since
``--no-index`` drops index URLs but keeps the find-links and constraints that a machine's pip.conf adds (this one's
add /opt/wheels).
"""

import json
import os
import re
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from stem_megatron.doctor.layered import canonical

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import wheelhouse  # noqa: E402

NODE = ("torch", "numpy", "tokenizers", "einops", "pytest", "ninja")  # as docs/gpu_node_freeze.txt
CARRY_LIMIT = 64 << 20  # what a call to the lent GPU machine carries (the checkout included)


def closure(names) -> list[metadata.Distribution]:
    """The distributions ``names`` need here, the requirements of their extras included (torch's cuda-toolkit[...])."""
    found, seen, todo = {}, set(), [Requirement(n) for n in names]
    while todo:
        req = todo.pop()
        key = (canonical(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        dist = found.setdefault(key[0], metadata.distribution(req.name))
        todo += [r for r in map(Requirement, dist.requires or [])
                 if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in {"", *req.extras})]
    return list(found.values())


def node_python(venv: Path) -> Path:
    """A venv whose site-packages links this one's entries of the node's packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv)}))
    here = Path(sysconfig.get_path("purelib"))
    entries = {f.parts[0] for dist in closure(NODE) for f in dist.files if f.parts[0] not in ("..", "__pycache__")}
    for entry in entries:
        (site / entry).symlink_to(here / entry)
    return venv / "bin" / "python"


def torch_files(python: Path) -> dict[str, tuple[int, int]]:
    """Size and mtime of every file torch's RECORD lists in that Python's site-packages."""
    out = subprocess.run([str(python), "-c", """
import json, os
from importlib import metadata
dist = metadata.distribution("torch")
files = [dist.locate_file(f) for f in dist.files if f.parts[0] != ".."]
print(json.dumps({str(f): (os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files}))
"""], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_platforms_take_every_older_manylinux():
    """pip matches --platform exactly; a manylinux_2_28 node runs manylinux2014 wheels too (msgpack's, psutil's)."""
    names = wheelhouse.platforms("manylinux_2_28_x86_64")
    assert names[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in names
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"} <= set(names)
    assert "manylinux_2_29_x86_64" not in names
    assert wheelhouse.platforms("macosx_11_0_arm64") == ["macosx_11_0_arm64"]


def test_a_freeze_with_urls_names_the_command_that_writes_versions(tmp_path):
    freeze = tmp_path / "node.txt"
    freeze.write_text("numpy==2.5.5\ntorch @ file:///opt/wheels/torch-2.11.0-cp312-linux_x86_64.whl\n")
    with pytest.raises(wheelhouse.Failed, match=r"node\.txt:2: 'torch @ file:.*' is not name==version: write the "
                                                r"file with `python3 -m pip list --format=freeze` on the node"):
        wheelhouse.read_freeze(freeze)
    freeze.write_text("# the node\nTorch==2.11.0+cu130\ntyping_extensions==4.16.0\n")
    assert wheelhouse.read_freeze(freeze) == {"torch": "2.11.0+cu130", "typing-extensions": "4.16.0"}


def test_the_wheelhouse_carries_the_hugging_face_paths_and_names_an_unknown_extra():
    """By default the wheelhouse holds what the Hugging Face import, export and calibration need (the hf extra:
    transformers) beside pytest; lm-eval (eval) only when asked, its datasets and pyarrow being ~150 MiB."""
    names = {canonical(Requirement(r).name) for r in wheelhouse.requirements()}
    assert {"transformers", "accelerate", "pytest", "megatron-core"} <= names and "lm-eval" not in names
    assert "lm-eval" in {canonical(Requirement(r).name) for r in wheelhouse.requirements(("test", "hf", "eval"))}
    with pytest.raises(wheelhouse.Failed, match="no extra hf2 in pyproject.toml: EXTRAS takes .*eval.*hf"):
        wheelhouse.requirements(("test", "hf2"))


@pytest.mark.slow
def test_offline_setup_reuses_the_nodes_torch(tmp_path):
    python = node_python(tmp_path / "node")
    freeze = tmp_path / "node-freeze.txt"
    freeze.write_text(subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "list",
                                      "--format=freeze"], capture_output=True, text=True, check=True).stdout)
    node = wheelhouse.read_freeze(freeze)
    before = torch_files(python)
    assert len(before) > 1000  # every file of the torch wheel

    house = tmp_path / "wheelhouse"
    proc = subprocess.run(["make", "--no-print-directory", "wheelhouse", f"WHEELHOUSE={house}",
                           f"TARGET_FREEZE={freeze}", f"PYTHON={sys.executable}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr
    wheels = sorted(house.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    assert size < CARRY_LIMIT, f"{size / 2**20:.1f} MiB"
    names = {canonical(w.name.split("-")[0]) for w in wheels}
    assert not names & set(node), names & set(node)  # nothing the node has (torch, its CUDA libraries, numpy, ...)
    assert {"megatron-core", "deepspeed", "hydra-core", "antlr4-python3-runtime", "transformers", "safetensors"} <= names
    for built in ("deepspeed-0.19.8-py3-none-any.whl", "antlr4_python3_runtime-4.9.3-py3-none-any.whl"):
        assert (house / built).is_file(), built  # PyPI has sdists only: built here, pure Python
    assert f"{len(wheels)} wheels, {size / 2**20:.1f} MiB" in proc.stdout

    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {
        "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "VENV": str(venv), "PYTHON": str(python),
        "WHEELHOUSE": str(house), "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}
    proc = subprocess.run(["bash", "tools/setup.sh"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    node_site = Path(sysconfig.get_path("purelib", vars={"base": str(tmp_path / "node")}))
    assert (f"reusing torch {node['torch']} from {node_site}: not installed here, pinned in {venv}/constraints.txt"
            in proc.stdout.splitlines())
    assert (venv / "constraints.txt").read_text() == f"torch=={node['torch']}\n"

    proc = subprocess.run([str(venv / "bin" / "python"), "-W", "ignore", "-c", """
import json, torch, megatron.core, deepspeed, hydra, transformers, safetensors
from importlib import metadata
from stem_megatron.host_tables.row_optimizer import RowAdam
RowAdam((0.9, 0.95), 1e-8, 0)
print(json.dumps({"torch": metadata.version("torch"), "file": torch.__file__}))
"""], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found == {"torch": node["torch"], "file": str(node_site / "torch" / "__init__.py")}
    own = Path(sysconfig.get_path("purelib", vars={"base": str(venv)}))
    assert not [p.name for p in own.iterdir() if re.match(r"torch[-_.]|torch$", p.name)]
    assert torch_files(python) == before
