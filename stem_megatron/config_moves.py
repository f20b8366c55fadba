"""The keys of ``host_tables.*`` (where the tables live, how they are trained) and ``hash_moe.*`` (the Hash-Layer
baseline) that the flat ``stem`` layout holds under ``stem``.

A recipe or override that sets one under ``stem`` is refused with its place (``recipes.refuse_moved_keys``): Hydra's
own error names only the missing key. Runs written in the flat layout keep working: a checkpoint's manifest names a
run by the flat ``stem`` (``flat_stem``), and a saved ``config.json`` in that layout is translated when read
(``upgrade_saved_config``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Sequence

from stem_megatron.config import ConfigError, HashMoEConfig, HostTablesConfig

# a key of the flat stem -> the group that holds it
MOVED = {f.name: group for group, schema in (("host_tables", HostTablesConfig), ("hash_moe", HashMoEConfig))
         for f in dataclasses.fields(schema)}
_OVERRIDE = re.compile(r"(~|\+\+|\+)?stem\.(\w+)(=|$)")  # Hydra's set, add, force-add and delete forms


def new_key(key: str) -> str:
    """The full name of a key of the flat ``stem`` (``placement``: ``host_tables.placement``)."""
    return f"{MOVED.get(key, 'stem')}.{key}"


def _moved(key: str) -> str:
    return f"stem has no key {key}, it is {new_key(key)}"


def refuse_moved_override(overrides: Sequence[str]) -> None:
    """ConfigError for a command-line override of a moved key, naming the override to write instead."""
    for line in overrides:
        found = _OVERRIDE.match(line)
        if found and found[2] in MOVED:
            raise ConfigError(f"{_moved(found[2])}: write {line.replace('stem.', f'{MOVED[found[2]]}.', 1)}")


def refuse_moved_in_recipe(error: BaseException) -> None:
    """ConfigError in place of Hydra's composition ``error`` when that is a moved key set under ``stem`` (Hydra: "In
    'experiment/x': ... Key 'optimizer' not in 'STEMConfig'", the OmegaConf error its cause or context); else
    nothing."""
    cause = error.__cause__ or error.__context__
    while cause is not None:
        group, _, key = (getattr(cause, "full_key", None) or "").partition(".")
        if group == "stem" and key in MOVED:
            recipe = re.match(r"In '([^']+)'", str(error))
            where = f"recipe {recipe[1]}" if recipe else "the command line"
            raise ConfigError(f"{_moved(key)}: {where} sets it under stem:, set it under {MOVED[key]}: instead")
        cause = cause.__cause__ or cause.__context__


def flat_stem(stem: Mapping, host_tables: Mapping, hash_moe: Mapping) -> dict:
    """The flat ``stem`` dict (its keys, in its order) from the three groups' dicts: what a checkpoint's manifest and
    a run directory's digest name a run by, so runs in the flat layout resume and keep their directory."""
    return {**stem, **host_tables, **hash_moe}


def upgrade_saved_config(config: dict) -> dict:
    """A saved run's ``config.json`` dict (``dataclasses.asdict`` of its RunConfig) in the grouped layout: the keys
    of a flat ``stem`` go to their groups. Changes ``config`` in place and returns it."""
    stem = config.get("stem", {})
    for key in [k for k in stem if k in MOVED]:
        config.setdefault(MOVED[key], {})[key] = stem.pop(key)
    return config
