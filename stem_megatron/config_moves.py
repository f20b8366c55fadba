"""The keys issue 54 moved out of ``stem``: ``host_tables.*`` (where the tables live, how they are trained) and
``hash_moe.*`` (the Hash-Layer baseline).

What earlier runs wrote keeps working: a checkpoint's manifest still names a run by the flat ``stem`` of before
(``flat_stem``), and a saved ``config.json`` of that layout is translated when read (``upgrade_saved_config``).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from stem_megatron.config import HashMoEConfig, HostTablesConfig

# a key of the old flat stem -> the group that holds it now
MOVED = {f.name: group for group, schema in (("host_tables", HostTablesConfig), ("hash_moe", HashMoEConfig))
         for f in dataclasses.fields(schema)}


def new_key(key: str) -> str:
    """Today's full name of a key of the old flat ``stem`` (``placement``: ``host_tables.placement``)."""
    return f"{MOVED.get(key, 'stem')}.{key}"


def flat_stem(stem: Mapping, host_tables: Mapping, hash_moe: Mapping) -> dict:
    """The ``stem`` dict of before issue 54 (its keys, in its order) from the three groups' dicts: what a checkpoint's
    manifest and a run directory's digest still name a run by, so runs from before resume and keep their directory."""
    return {**stem, **host_tables, **hash_moe}


def upgrade_saved_config(config: dict) -> dict:
    """A saved run's ``config.json`` dict (``dataclasses.asdict`` of its RunConfig) in today's layout: the moved keys
    of a flat ``stem`` written before issue 54 go to their groups. Changes ``config`` in place and returns it."""
    stem = config.get("stem", {})
    for key in [k for k in stem if k in MOVED]:
        config.setdefault(MOVED[key], {})[key] = stem.pop(key)
    return config
