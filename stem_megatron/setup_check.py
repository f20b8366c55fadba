"""What `make setup` provides, checked where its absence would otherwise end in a traceback.

``make setup`` builds ``.venv`` (stem-megatron and its dependencies) and the demo corpus
(``data_cache/python-doc``). A script under ``benchmarks/`` or ``tools/`` run by another Python (a system
``python3``, a venv from before setup) would die in an import, and a run or script without a corpus in a file
open. Stdlib only, so that any Python gets as far as the message (a script puts the checkout on ``sys.path``
before importing this: such a Python does not have the package installed). Installed versions against the
requirements are ``stem-doctor``'s check.

Training needs the core requirements; a command that needs more (lm-eval, matplotlib, ...) names the extra that
installs it (``require_extra``), so a venv with the core only gets one line, not an ImportError.
"""

from __future__ import annotations

import re
import shlex
import sys
from importlib import metadata
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
DEMO_CORPUS = ROOT / "data_cache" / "python-doc"


def _in_checkout() -> bool:
    return Path.cwd().resolve() == ROOT


def _make_setup() -> str:
    return "make setup" if _in_checkout() else f"make -C {shlex.quote(str(ROOT))} setup"


def fix() -> str:
    """`make setup`, then this command again with the venv's Python: paths relative to the checkout when run
    from it, else absolute (the arguments stay as typed, relative to where they were typed)."""
    if _in_checkout():
        script = Path(sys.argv[0]).resolve().relative_to(ROOT)
        again = shlex.join([".venv/bin/python", str(script), *sys.argv[1:]])
    else:
        again = shlex.join([str(ROOT / ".venv" / "bin" / "python"), str(Path(sys.argv[0]).resolve()), *sys.argv[1:]])
    return f"run `{_make_setup()}`, then `{again}`"


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def required(extra: Optional[str] = None) -> list[str]:
    """The packages the project's metadata requires: its core (``extra=None``) or one extra's. The metadata may
    come from the checkout itself (setup's ``stem_megatron.egg-info``), so requirements are looked up by name.
    Raises ``PackageNotFoundError`` when this Python does not have the project."""
    names = []
    for line in metadata.requires("stem-megatron") or []:  # e.g. 'lm-eval==0.4.13; extra == "eval"'
        marker = re.search(r"""extra == ["']([^"']+)["']""", line)
        if (marker.group(1) if marker else None) == extra:
            names.append(re.match(r"[A-Za-z0-9._-]+", line).group())
    return names


def environment_problem() -> Optional[str]:
    """What this Python lacks of the project's environment, or None."""
    try:
        missing = [name for name in required() if not _installed(name)]
    except metadata.PackageNotFoundError:
        return f"this Python ({sys.executable}) does not have stem-megatron installed"
    if not missing:
        return None
    named = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more of the project's packages"
                                      if len(missing) > 3 else "")
    return f"this Python ({sys.executable}) does not have {named}"


def require_environment() -> None:
    """Exit with one line naming `make setup` and the venv's Python if this Python lacks the environment."""
    problem = environment_problem()
    if problem:
        raise SystemExit(f"{Path(sys.argv[0]).name}: {problem}: {fix()}")


def extra_problem(*extras: str) -> Optional[str]:
    """Which of the project's ``extras`` this Python lacks, the packages missing and the fix; None if it has them.
    The fix installs into this Python (the one the command runs on), or `make setup` installs every extra."""
    missing = {extra: [name for name in required(extra) if not _installed(name)] for extra in extras}
    missing = {extra: names for extra, names in missing.items() if names}
    if not missing:
        return None
    names = [name for names in missing.values() for name in names]
    python = Path(sys.executable)
    if _in_checkout() and python.is_relative_to(ROOT):
        python = python.relative_to(ROOT)
    target = f"{'.' if _in_checkout() else ROOT}[{','.join(missing)}]"
    return (f"needs the {' and '.join(repr(extra) for extra in missing)} extra{'s' * (len(missing) > 1)} "
            f"({' and '.join(names)} {'is' if len(names) == 1 else 'are'} not installed): run `{_make_setup()}`, "
            f"or `{shlex.join([str(python), '-m', 'pip', 'install', '-e', target])}`")


def require_extra(*extras: str, command: Optional[str] = None) -> None:
    """Exit with one line naming the missing extras and their fix if this Python lacks any of ``extras``: called
    by a command before it imports what they install (``command``: its name, default the script's)."""
    problem = extra_problem(*extras)
    if problem:
        raise SystemExit(f"{command or Path(sys.argv[0]).name}: {problem}")


def corpus_problem(corpus: Path) -> Optional[str]:
    """Why ``corpus`` (a prepared data directory) cannot be read, naming the fix; None if it can."""
    if (Path(corpus) / "tokenizer.json").is_file():
        return None
    return (f"{corpus}/tokenizer.json is missing: `make setup` builds the demo corpus "
            f"({DEMO_CORPUS.relative_to(ROOT)}), `stem-preprocess` any other (README, Data)")
