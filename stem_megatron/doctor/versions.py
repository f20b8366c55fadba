"""Installed versions against what the project declares, from package metadata (nothing imported).

The Transformer Engine versions a TE must be in are our ``gpu`` extra's (``transformer-engine[pytorch]>=2.9,<2.21``
in pyproject.toml), read from our installed metadata: megatron-core 0.19.2 names TE without a version (its ``te``
extra).
"""

from __future__ import annotations

from importlib import metadata
from typing import Optional

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

TE = "transformer-engine"
PROJECT = "stem-megatron"


def installed(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def te_range() -> SpecifierSet:
    """The supported Transformer Engine versions: the range of our ``gpu`` extra."""
    for line in metadata.requires(PROJECT) or []:
        req = Requirement(line)
        if req.name == TE and req.marker is not None and req.marker.evaluate({"extra": "gpu"}):
            return req.specifier
    raise LookupError(f"{PROJECT}'s metadata has no transformer-engine in its gpu extra")


def in_range(version: str, spec: SpecifierSet) -> bool:
    """``version`` (e.g. ``2.17.1``, an NGC build ``2.17.0+4e0f6ab``, a pre-release ``2.20.0rc1``) is in ``spec``;
    pre-releases count when the spec admits them (``2.20.0rc1`` is in ``<2.21``, ``2.21.0.dev0`` is not)."""
    try:
        return spec.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def unmet_requirements() -> list[str]:
    """The project's own requirements (no extras) that the installed packages do not satisfy."""
    unmet = []
    for line in metadata.requires(PROJECT) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        have = installed(req.name)
        if have is None:
            unmet.append(f"{req.name} is not installed")
        elif not in_range(have, req.specifier):
            unmet.append(f"{req.name} {have} is not {req.specifier}")
    return unmet
