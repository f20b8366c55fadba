"""What `make setup` provides, checked where its absence would otherwise end in a traceback.

``make setup`` builds ``.venv`` (stem-megatron and its dependencies) and the demo corpus
(``data_cache/python-doc``). A script under ``benchmarks/`` or ``tools/`` run by another Python (a system
``python3``, a venv from before setup) would die in an import, and a run or script without a corpus in a file
open. Stdlib only, so that any Python gets as far as the message (a script puts the checkout on ``sys.path``
before importing this: such a Python does not have the package installed). Installed versions against the
requirements are ``stem-doctor``'s check.
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


def fix() -> str:
    """`make setup`, then this command again with the venv's Python: paths relative to the checkout when run
    from it, else absolute (the arguments stay as typed, relative to where they were typed)."""
    if Path.cwd().resolve() == ROOT:
        script = Path(sys.argv[0]).resolve().relative_to(ROOT)
        return f"run `make setup`, then `{shlex.join(['.venv/bin/python', str(script), *sys.argv[1:]])}`"
    again = shlex.join([str(ROOT / ".venv" / "bin" / "python"), str(Path(sys.argv[0]).resolve()), *sys.argv[1:]])
    return f"run `make -C {shlex.quote(str(ROOT))} setup`, then `{again}`"


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def environment_problem() -> Optional[str]:
    """What this Python lacks of the project's environment, or None. The project's metadata may come from the
    checkout itself (setup's ``stem_megatron.egg-info``), so its requirements are looked up one by one."""
    try:
        requires = metadata.requires("stem-megatron") or []
    except metadata.PackageNotFoundError:
        return f"this Python ({sys.executable}) does not have stem-megatron installed"
    names = [re.match(r"[A-Za-z0-9._-]+", line).group() for line in requires if "extra ==" not in line]
    missing = [name for name in names if not _installed(name)]
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


def corpus_problem(corpus: Path) -> Optional[str]:
    """Why ``corpus`` (a prepared data directory) cannot be read, naming the fix; None if it can."""
    if (Path(corpus) / "tokenizer.json").is_file():
        return None
    return (f"{corpus}/tokenizer.json is missing: `make setup` builds the demo corpus "
            f"({DEMO_CORPUS.relative_to(ROOT)}), `stem-preprocess` any other (README, Data)")
