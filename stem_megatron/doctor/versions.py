"""Installed versions against what the project declares, from package metadata (nothing imported).

The Transformer Engine versions a TE must be in are our ``gpu`` extra's (``transformer-engine[pytorch]>=2.9,<2.21``
in pyproject.toml), read from our installed metadata: megatron-core 0.19.2 names TE without a version (its ``te``
extra). torch, TE and Apex may come from the environment the venv was layered on (``layered``); ``found`` says
which.
"""

from __future__ import annotations

from importlib import metadata
from typing import Optional

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from stem_megatron.doctor import layered

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


def requirement(name: str) -> SpecifierSet:
    """The project's own (core) requirement on ``name``; empty when it names none."""
    for line in metadata.requires(PROJECT) or []:
        req = Requirement(line)
        if req.name == name and (req.marker is None or req.marker.evaluate({"extra": ""})):
            return req.specifier
    return SpecifierSet()


def found() -> list[str]:
    """torch, Transformer Engine and Apex (when there) as the versions line shows them: the version, whether it
    comes from the venv or from the environment it was layered on, and whether it fits (torch: the project's
    requirement; TE: the gpu extra's range), e.g. ``torch 2.11.0+cu130 (from /opt/torch/.venv/lib/python3.12/
    site-packages, fits >=2.6)``."""
    dists = layered.machine_built()

    def describe(name: str, spec: Optional[SpecifierSet], what: str) -> str:
        dist = dists.get(name)
        if dist is None:
            return f"{name} not installed"
        where = "venv" if dist.own else f"from {dist.location}"
        if spec is None:
            return f"{name} {dist.version} ({where})"
        fits = "fits" if in_range(dist.version, spec) else "not in"
        return f"{name} {dist.version} ({where}, {fits} {what}{spec})"

    lines = [describe(layered.TORCH, requirement(layered.TORCH), ""), describe(TE, te_range(), "the gpu extra's ")]
    if layered.APEX in dists:
        lines.append(describe(layered.APEX, None, ""))
    return lines


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
