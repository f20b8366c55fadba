#!/usr/bin/env python3
"""Builds a wheelhouse for a GPU node without a package registry: every wheel `make setup PYTHON=... WHEELHOUSE=DIR`
installs there, for that node's Python and platform, less what the node already has (docs/gpu.md, Offline GPU nodes).

Run where pip reaches an index, by any Python >= 3.11 with pip (it needs none of the project):
``make wheelhouse WHEELHOUSE=DIR TARGET_FREEZE=FILE [TARGET_PYTHON=3.12] [TARGET_PLATFORM=manylinux_2_28_x86_64]``,
FILE being ``python3 -m pip list --format=freeze`` on the node.

pip's own resolver decides, in a throwaway venv of a Python of the node's version (pip evaluates markers such as
``python_version < "3.13"`` with the Python it runs on) that holds the node's packages as installed stubs (a
dist-info with name and version): pip keeps an installed package that satisfies a requirement, as pip on the node
will, and never looks a kept one up, so a torch no index has (``2.11.0+cu130``, an NGC build) resolves, and torch,
Transformer Engine and Apex are pinned (a requirement against them fails here rather than pulling a torch). What PyPI
has only as an sdist (DeepSpeed 0.19.8, antlr4-python3-runtime 4.9.3) is built here into a pure-Python wheel.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from stem_megatron.doctor.layered import canonical, is_machine_built  # noqa: E402 - stdlib only, from this checkout

CONTENTS = "wheelhouse.txt"  # what the wheelhouse holds, written into it
RESOLVER_PIP = "pip>=25"  # --dry-run --report with --python-version / --platform
PROG = "wheelhouse.py"


class Failed(Exception):
    """One line naming what went wrong and its fix."""


EXTRAS = ("test", "hf")  # pytest; the Hugging Face import, export and calibration (transformers): ~17 MiB
EXTRAS_LINE = "# extras: "  # wheelhouse.txt's line that tells setup which extras it holds


def requirements(extras: tuple[str, ...] = EXTRAS) -> list[str]:
    """What `make setup WHEELHOUSE=DIR` installs: the core requirements, ``extras`` (pyproject.toml's), and the build
    system's (setuptools: the editable install builds without isolation, offline)."""
    import tomllib  # Python >= 3.11, checked in main

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    optional = project["project"]["optional-dependencies"]
    unknown = sorted(set(extras) - set(optional))
    if unknown:
        raise Failed(f"no extra {', '.join(unknown)} in pyproject.toml: EXTRAS takes {', '.join(sorted(optional))}")
    return [*project["project"]["dependencies"], *(r for extra in extras for r in optional[extra]),
            *project["build-system"]["requires"]]


def read_freeze(path: Path) -> dict[str, str]:
    """``name==version`` lines (``pip list --format=freeze``) by canonical name."""
    found = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        if not sep or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name.strip()):
            raise Failed(f"{path}:{number}: {line!r} is not name==version: write the file with `python3 -m pip list "
                         f"--format=freeze` on the node (`pip freeze` writes URLs for some)")
        found[canonical(name.strip())] = version.strip()
    return found


def platforms(platform: str) -> list[str]:
    """pip matches --platform exactly: a manylinux_2_N platform also runs every older manylinux wheel."""
    match = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not match:
        return [platform]
    glibc, arch = int(match.group(1)), match.group(2)
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    names = [f"manylinux_2_{minor}_{arch}" for minor in range(glibc, 4, -1)]
    return names + [f"{legacy[minor]}_{arch}" for minor in sorted(legacy, reverse=True) if minor <= glibc]


def find_python(version: str) -> str:
    """A Python of the node's version here: this one, python3.X on PATH, or one pyenv has installed."""
    candidates = [sys.executable, f"python{version}"]
    pyenv = shutil.which("pyenv")
    if pyenv:
        root = subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip()
        candidates += sorted(str(p) for p in Path(root, "versions").glob(f"{version}*/bin/python{version}"))
    for candidate in candidates:
        probe = subprocess.run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True) if shutil.which(candidate) else None
        if probe and probe.returncode == 0 and probe.stdout.strip() == version:
            return candidate
    raise Failed(f"no Python {version} here (pip evaluates markers with the Python it runs on): install "
                 f"python{version}, or set TARGET_PYTHON to the node's version")


def pip(python: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True)


def pip_error(proc: subprocess.CompletedProcess) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")]
    return (errors[-1] if errors else (proc.stderr.strip().splitlines() or ["no output"])[-1]).removeprefix("ERROR: ")


def node_venv(workdir: Path, python: str, node: dict[str, str]) -> Path:
    """A venv with a recent pip and the node's packages as installed stubs (none that the venv's pip itself is)."""
    venv = workdir / "node"
    subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True)
    proc = pip(Path(sys.executable), "--python", str(venv / "bin" / "python"), "install", "-q", RESOLVER_PIP)
    if proc.returncode:
        raise Failed(f"installing {RESOLVER_PIP} for the resolver: {pip_error(proc)}")
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path("
                                "'purelib'))"], capture_output=True, text=True, check=True).stdout.strip())
    for name, version in node.items():
        if name == "pip":
            continue
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return venv / "bin" / "python"


def resolve(python: Path, wheelhouse: Path, target: list[str], pins: Path, report: Path,
            extras: tuple[str, ...]) -> list[dict]:
    """What pip would install on the node. First for this machine's platform, sdists allowed: the requirements
    that have only an sdist are built into the wheelhouse (a wheel there from an earlier run is found instead);
    then for the node's, wheels only."""
    def dry_run(*restrict: str) -> list[dict]:
        proc = pip(python, "install", "--dry-run", "-q", "--report", str(report), *restrict, "-c", str(pins),
                   "--find-links", str(wheelhouse), *requirements(extras))
        if proc.returncode:
            raise Failed(f"pip cannot resolve for the node: {pip_error(proc)}")
        return json.loads(report.read_text())["install"]

    for item in dry_run("--prefer-binary"):
        url = item["download_info"]["url"]
        if not urlparse(url).path.endswith(".whl"):
            build_wheel(python, item["metadata"]["name"], url, wheelhouse, target)
    return dry_run(*target)


def build_wheel(python: Path, name: str, sdist: str, wheelhouse: Path, target: list[str]) -> None:
    """``name`` from its sdist, into the wheelhouse; only a pure-Python wheel runs on the node."""
    with tempfile.TemporaryDirectory() as out:
        proc = pip(python, "wheel", "-q", "--no-deps", "-w", out, sdist)
        if proc.returncode:
            raise Failed(f"{name} has only an sdist, which does not build here: {pip_error(proc)}")
        (wheel,) = Path(out).glob("*.whl")
        if not wheel.name.endswith("-none-any.whl"):
            raise Failed(f"{name} has only an sdist, which builds {wheel.name} here, not a pure-Python wheel: put a "
                         f"wheel of it for the node ({' '.join(target)}) into the index")
        shutil.move(wheel, wheelhouse / wheel.name)


def fetch(python: Path, plan: list[dict], wheelhouse: Path, target: list[str]) -> list[Path]:
    """The planned wheels in the wheelhouse (downloading those not yet there); any other wheel there removed."""
    urls = [item["download_info"]["url"] for item in plan]
    wanted = [wheelhouse / Path(unquote(urlparse(url).path)).name for url in urls]
    missing = [url for url, path in zip(urls, wanted) if not path.exists()]
    if missing:
        proc = pip(python, "download", "-q", "--no-deps", *target, "-d", str(wheelhouse), *missing)
        if proc.returncode:
            raise Failed(f"downloading the wheels: {pip_error(proc)}")
    for stale in set(wheelhouse.glob("*.whl")) - set(wanted):
        stale.unlink()
    return wanted


def build(wheelhouse: Path, freeze: Path, python_version: str, platform: str, extras: tuple[str, ...] = EXTRAS) -> str:
    start = time.monotonic()
    node = read_freeze(freeze)
    wheelhouse.mkdir(parents=True, exist_ok=True)
    target = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
              *(arg for name in platforms(platform) for arg in ("--platform", name))]
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as tmp:
        workdir = Path(tmp)
        python = node_venv(workdir, find_python(python_version), node)
        pins = workdir / "pins.txt"  # the node's torch / TE / Apex: what setup will pin there
        pins.write_text("".join(f"{name}=={version}\n" for name, version in node.items() if is_machine_built(name)))
        plan = resolve(python, wheelhouse, target, pins, workdir / "report.json", extras)
        wheels = fetch(python, plan, wheelhouse, target)
    size = sum(w.stat().st_size for w in wheels)
    took = time.monotonic() - start
    lines = [f"# {len(wheels)} wheels, {size / 2**20:.1f} MiB, for Python {python_version} on {platform}, beside the "
             f"{len(node)} packages of {freeze.name} (tools/wheelhouse.py, {time.strftime('%Y-%m-%d')})",
             f"{EXTRAS_LINE}{','.join(extras)}"]
    lines += [f"{item['metadata']['name']}=={item['metadata']['version']}  {wheel.name}  {wheel.stat().st_size}"
              for item, wheel in sorted(zip(plan, wheels), key=lambda pair: canonical(pair[0]["metadata"]["name"]))]
    (wheelhouse / CONTENTS).write_text("\n".join(lines) + "\n")
    return (f"{wheelhouse}: {len(wheels)} wheels, {size / 2**20:.1f} MiB, built in {took:.0f} s (contents: "
            f"{wheelhouse / CONTENTS}); carry it to the node's checkout and run `make setup PYTHON=<the node's "
            f"python3> WHEELHOUSE=<it>` there")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--wheelhouse", type=Path, required=True, help="the directory to fill (WHEELHOUSE)")
    parser.add_argument("--freeze", type=Path, required=True,
                        help="the node's `python3 -m pip list --format=freeze` (TARGET_FREEZE)")
    parser.add_argument("--python-version", default="3.12", help="the node's Python (TARGET_PYTHON; default 3.12)")
    parser.add_argument("--platform", default="manylinux_2_28_x86_64",
                        help="the node's wheel platform (TARGET_PLATFORM; default manylinux_2_28_x86_64)")
    parser.add_argument("--extras", default=",".join(EXTRAS),
                        help=f"pyproject.toml's extras beside the core (EXTRAS; default {','.join(EXTRAS)}; "
                             f"eval adds lm-eval, ~150 MiB with its datasets and pyarrow)")
    args = parser.parse_args(argv)
    if sys.version_info < (3, 11):
        raise SystemExit(f"{PROG}: needs Python >= 3.11 (tomllib), this is {sys.version.split()[0]}: run "
                         f"`make wheelhouse PYTHON=python3.12 ...`")
    if str(args.wheelhouse) == "." or not args.freeze.is_file():  # make passes "" for a variable not set
        raise SystemExit(f"{PROG}: run `make wheelhouse WHEELHOUSE=DIR TARGET_FREEZE=FILE`, FILE being `python3 -m pip "
                         f"list --format=freeze` on the node (given: WHEELHOUSE={str(args.wheelhouse)!r}, "
                         f"TARGET_FREEZE={str(args.freeze)!r})")
    try:
        extras = tuple(e.strip() for e in args.extras.split(",") if e.strip())
        print(build(args.wheelhouse.resolve(), args.freeze, args.python_version, args.platform, extras), flush=True)
    except Failed as e:
        raise SystemExit(f"{PROG}: {e}") from None


if __name__ == "__main__":
    main()
