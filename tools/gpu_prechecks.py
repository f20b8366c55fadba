"""What a GPU node lacks, found in seconds before ``make gpu-check`` spends its minutes (the standard library and the
package's stdlib-only ``doctor/nvidia_smi.py``: the node's Python runs it before any setup). One line a check, a FAIL or WARN naming its fix:

- a GPU the driver lists (``nvidia-smi -L``): nothing else runs without one;
- a C++ compiler (``CXX``, ``c++``, ``g++``) and ``ninja`` (on PATH, beside this Python, or a wheel in the wheelhouse):
  the row-Adam op is built at setup with them;
- a C compiler (``CC``, ``cc``, ``gcc``, ``clang``) and this Python's ``Python.h``: ``torch.compile``'s inductor and
  Triton build their launchers with them (the working-set runs compile the STEM layer);
- room in ``/dev/shm`` for the largest host tables the planned parts build (their table parameters x
  ``SHM_BYTES_PER_PARAM``, the memory plan's figure for a node's shared tables).
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

from stem_megatron.doctor.nvidia_smi import nvidia_smi_gpus as gpus

SHM_BYTES_PER_PARAM = 12  # fp32 rows and two fp32 moments in /dev/shm (flops/memory.py's node_shared_bytes)
OK, WARN, FAIL = "ok", "WARN", "FAIL"


def _first(env: str, names: tuple[str, ...]) -> str | None:
    given = os.environ.get(env)
    if given:
        return shutil.which(given.split()[0])
    return next((found for found in map(shutil.which, names) if found), None)


def _ninja(wheelhouse: str | None) -> str | None:
    beside = Path(sys.executable).parent / "ninja"
    if shutil.which("ninja") or beside.is_file():
        return shutil.which("ninja") or str(beside)
    if wheelhouse and any(Path(wheelhouse).glob("ninja-*.whl")):
        return f"a wheel in {wheelhouse} (setup installs it beside the venv's Python)"
    return None


def checks(shm_bytes: int, shm_dir: str = "/dev/shm", wheelhouse: str | None = None) -> list[tuple[str, str, str]]:
    """(status, name, detail) for each check; ``shm_bytes``: the largest host tables a planned run builds."""
    found = []
    n = gpus()
    found.append((OK, "GPU", f"{n} listed by nvidia-smi") if n else
                 (FAIL, "GPU", "nvidia-smi lists none: run gpu-check on a GPU node (docs/gpu.md)"))
    cxx = _first("CXX", ("c++", "g++", "clang++"))
    found.append((OK, "C++ compiler", cxx) if cxx else
                 (FAIL, "C++ compiler", "none (CXX, c++, g++): the row-Adam op cannot build; install g++ (apt-get "
                                        "install g++) or set CXX"))
    ninja = _ninja(wheelhouse)
    found.append((OK, "ninja", ninja) if ninja else
                 (FAIL, "ninja", "not on PATH, beside this Python, or in the wheelhouse: the op build needs it; "
                                 "rebuild the wheelhouse (DeepSpeed requires ninja) or install it"))
    cc = _first("CC", ("cc", "gcc", "clang"))
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    missing = [what for what, there in (("a C compiler (CC, cc, gcc, clang)", cc), (f"{header}", header.is_file()))
               if not there]
    found.append((OK, "torch.compile", f"{cc}, {header}") if not missing else
                 (WARN, "torch.compile", f"no {' and no '.join(missing)}: inductor and Triton cannot build, so the "
                                         f"working-set runs fail; install gcc and python3-dev for this Python"))
    try:
        stat = os.statvfs(shm_dir)
        free = stat.f_bavail * stat.f_frsize
    except OSError:
        free = 0
    found.append((OK, "/dev/shm", f"{free / 1e9:.1f} GB free, {shm_bytes / 1e9:.1f} GB needed") if free >= shm_bytes
                 else (WARN, "/dev/shm", f"{free / 1e9:.1f} GB free of the {shm_bytes / 1e9:.1f} GB the largest "
                                         f"planned host tables need: those runs fail; enlarge it (mount -o "
                                         f"remount,size=... /dev/shm, or a container's --shm-size)"))
    return found


def fatal(found: list[tuple[str, str, str]]) -> list[str]:
    """The checks that stop the check before setup."""
    return [name for status, name, _ in found if status == FAIL]


def lines(found: list[tuple[str, str, str]]) -> list[str]:
    return [f"{status:<5} {name}: {detail}" for status, name, detail in found]
