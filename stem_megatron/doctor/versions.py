"""Installed versions against what the project and megatron-core declare, from package metadata (nothing imported).

megatron-core 0.16.1 states the Transformer Engine versions it supports in its ``dev`` extra
(``transformer-engine[core_cu13,pytorch]<2.12.0,>=2.9.0a0``): that range, read from its installed metadata, is
what a TE must satisfy.
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
    """megatron-core's supported Transformer Engine versions."""
    for line in metadata.requires("megatron-core") or []:
        req = Requirement(line)
        if req.name == TE:
            return req.specifier
    raise LookupError("megatron-core's metadata names no transformer-engine requirement")


def in_range(version: str, spec: SpecifierSet) -> bool:
    """``version`` (e.g. ``2.10.0``, an NGC build ``2.11.0+4e0f6ab``, a pre-release ``2.12.0.dev0``) is in ``spec``;
    pre-releases count when the spec admits them (``>=2.9.0a0``)."""
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
