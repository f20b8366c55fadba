"""What a venv reuses from the environment it was layered on, and the pins that keep it.

``make setup PYTHON=...`` with a Python that already has torch (an NGC container's, a prepared venv such as
/opt/torch/.venv) makes the venv on top of that Python's packages instead of installing torch again: its torch,
Transformer Engine and Apex were built for the machine (CUDA, drivers, TE compiled against that very torch), and a
pip resolution that replaced them would break it. ``python -m stem_megatron.doctor.layered FILE`` (tools/setup.sh,
before anything is installed) writes them pinned to their versions into the constraints file every pip call there
uses. Stdlib only: it runs in a venv that has nothing of the project yet.
"""

from __future__ import annotations

import re
import sys
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

TORCH, APEX, TE_PREFIX = "torch", "apex", "transformer-engine"


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): ``transformer_engine_torch`` ->
    ``transformer-engine-torch``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_machine_built(name: str) -> bool:
    """torch, Apex and any Transformer Engine distribution (``transformer-engine``, ``transformer_engine_torch``,
    ``transformer-engine-cu12``, ...)."""
    name = canonical(name)
    return name in (TORCH, APEX) or name.startswith(TE_PREFIX)


@dataclass(frozen=True)
class Found:
    name: str  # canonical
    version: str
    location: Path  # the site-packages directory holding it
    own: bool  # in this Python's own site-packages (the venv's), not in an environment it was layered on


def _own_sites() -> set[Path]:
    return {Path(sysconfig.get_path(key)).resolve() for key in ("purelib", "platlib")}


def machine_built() -> dict[str, Found]:
    """torch / TE / Apex distributions this Python imports, by canonical name: the first of each name on sys.path,
    the one that imports (a venv's own copy shadows the environment's)."""
    own = _own_sites()
    found: dict[str, Found] = {}
    for dist in metadata.distributions():
        name = canonical(dist.metadata["Name"] or "")
        if is_machine_built(name) and name not in found:
            location = Path(dist.locate_file(""))
            found[name] = Found(name, dist.version, location, location.resolve() in own)
    return found


def reused() -> list[Found]:
    """The machine-built distributions that come from the environment this venv was layered on."""
    return sorted((f for f in machine_built().values() if not f.own), key=lambda f: f.name)


def write_constraints(path: Path) -> str:
    """Pins what this venv reuses into ``path`` (removed when it reuses nothing: a venv with its own torch) and
    returns the line saying what, or ''."""
    found = reused()
    if not found:
        path.unlink(missing_ok=True)
        return ""
    path.write_text("".join(f"{f.name}=={f.version}\n" for f in found))
    where = sorted({str(f.location) for f in found})
    return (f"reusing {', '.join(f'{f.name} {f.version}' for f in found)} from {', '.join(where)}: not installed "
            f"here, pinned in {path}")


if __name__ == "__main__":
    line = write_constraints(Path(sys.argv[1]))
    if line:
        print(line)
