"""Writes tests/durations.json, each test module's seconds in a full run, from that run's JUnit XML.

``make test`` runs the modules longest first (tests/conftest.py reads the file), so the two workers that share this
machine's two cores finish together instead of one waiting while the other runs the study or SLURM's module last.
A stale file costs balance, never a test: refresh it after a module grows or shrinks by a minute:

    make test ARGS="--junitxml=/tmp/suite.xml" && .venv/bin/python tools/test_durations.py /tmp/suite.xml
"""

from __future__ import annotations

import argparse
import collections
import json
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def module_seconds(junit: Path) -> dict[str, float]:
    """Each module's total seconds (setup, call and teardown of its tests), by its path under the repository."""
    totals: collections.Counter = collections.Counter()
    for case in ET.parse(junit).iter("testcase"):
        totals[case.get("classname").replace(".", "/") + ".py"] += float(case.get("time"))
    return {module: round(seconds, 1) for module, seconds in sorted(totals.items(), key=lambda kv: -kv[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path, help="pytest's --junitxml of a full run")
    args = parser.parse_args()
    seconds = module_seconds(args.junit)
    OUT.write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"wrote {OUT}: {len(seconds)} modules, {sum(seconds.values()):.0f} s")


if __name__ == "__main__":
    main()
