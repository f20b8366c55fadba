"""The keys issue 54 moved out of ``stem`` (to ``host_tables`` and ``hash_moe``): what runs wrote before keeps
working (a checkpoint's manifest names a run by the same flat ``stem``, a saved ``config.json`` of the old layout is
read as today's)."""

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from stem_megatron.config import HashMoEConfig, HostTablesConfig, RunConfig, to_run_config
from stem_megatron.config_moves import upgrade_saved_config

ROOT = Path(__file__).resolve().parents[1]
# ``dataclasses.asdict(RunConfig())["stem"]`` before issue 54, with some settings changed
OLD_STEM = {"variant": "hash_moe", "ratio": "1/2", "layers": None, "table_init": "xavier", "table_init_std": None,
            "placement": "device", "optimizer": "dense", "clip": "separate", "prefetch_depth": 3, "cache_rows": 0,
            "resident_rows": 0, "shm_dir": "/dev/shm", "host_memory_gib": 100.0, "wire_dtype": "bf16",
            "read_dtype": "fp32", "overlap_exchange": False, "overlap_update": True, "num_experts": 8,
            "expert_ffn_hidden_size": 32, "hash_map": "frequency:hash_counts.npy", "hash_seed": 7}


def test_a_checkpoint_names_its_run_by_the_flat_stem_of_before():
    """The manifest's ``stem`` is the dict every checkpoint wrote before issue 54 (its keys in its order), so one
    saved then resumes under today's settings and a changed moved setting is named by today's key."""
    from stem_megatron.checkpoint import manager
    from stem_megatron.checkpoint.atomic import CheckpointError

    saved = {k: v for k, v in OLD_STEM.items() if k not in ("prefetch_depth", "cache_rows", "shm_dir",
                                                           "host_memory_gib", "overlap_exchange", "overlap_update")}
    cfg = to_run_config(upgrade_saved_config({"stem": dict(OLD_STEM)}))
    assert list(manager._identity(cfg)["stem"].items()) == list(saved.items())
    layout = {"world": 1, "tp": 1, "pp": 1, "ep": 1, "dp": 1}
    manifest = {"model": manager._identity(cfg)["model"], "stem": saved, "layout": layout}
    manager._check_compatible(cfg, manifest, Path("ckpt"), layout)
    cfg.host_tables.wire_dtype = "fp32"
    with pytest.raises(CheckpointError, match=r"different stem config \(host_tables\.wire_dtype: checkpoint "
                                              r"\['bf16'\] vs this run \['fp32'\]\)"):
        manager._check_compatible(cfg, manifest, Path("ckpt"), layout)


def test_a_saved_config_of_the_old_layout_is_read_as_todays(tmp_path):
    """A run directory's or export's ``config.json`` from before issue 54 (a flat ``stem``): its moved keys land in
    their groups, here through ``tools/capacity_scaling.py``'s reader of an export's config."""
    old = {"model": {"num_layers": 4}, "stem": dict(OLD_STEM, variant="stem"), "train": {"steps": 7}}
    cfg = to_run_config(upgrade_saved_config(json.loads(json.dumps(old))))
    assert cfg.stem.variant == "stem" and cfg.stem.ratio == "1/2" and cfg.stem.table_init == "xavier"
    assert cfg.host_tables == HostTablesConfig(placement="device", optimizer="dense", clip="separate",
                                               prefetch_depth=3, host_memory_gib=100.0, wire_dtype="bf16",
                                               overlap_exchange=False)
    assert cfg.hash_moe == HashMoEConfig(num_experts=8, expert_ffn_hidden_size=32,
                                         hash_map="frequency:hash_counts.npy", hash_seed=7)
    assert cfg.train.steps == 7 and cfg.model.num_layers == 4
    today = json.loads(json.dumps(dataclasses.asdict(RunConfig())))
    assert upgrade_saved_config(json.loads(json.dumps(today))) == today  # today's layout stays as it is

    spec = importlib.util.spec_from_file_location("capacity_scaling", ROOT / "tools" / "capacity_scaling.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert tool.model_dims(tmp_path) == (RunConfig().model.ffn_hidden_size, 2, RunConfig().model.vocab_size)
