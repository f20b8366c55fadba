"""The keys moved out of ``stem`` (to ``host_tables`` and ``hash_moe``): a recipe or override that still sets
one ends ``stem-train`` with one line naming the new place; what runs wrote before keeps working (a checkpoint's
manifest names a run by the same flat ``stem``, a saved ``config.json`` of the old layout is read as today's)."""

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from stem_megatron.config import ConfigError, HashMoEConfig, HostTablesConfig, RunConfig, to_run_config
from stem_megatron.config_moves import upgrade_saved_config
from stem_megatron.recipes import compose_run, refuse_moved_keys

ROOT = Path(__file__).resolve().parents[1]
# ``dataclasses.asdict(RunConfig())["stem"]`` of the flat layout, with some settings changed
OLD_STEM = {"variant": "hash_moe", "ratio": "1/2", "layers": None, "table_init": "xavier", "table_init_std": None,
            "placement": "device", "optimizer": "dense", "clip": "separate", "prefetch_depth": 3, "cache_rows": 0,
            "resident_rows": 0, "shm_dir": "/dev/shm", "host_memory_gib": 100.0, "wire_dtype": "bf16",
            "read_dtype": "fp32", "overlap_exchange": False, "overlap_update": True, "num_experts": 8,
            "expert_ffn_hidden_size": 32, "hash_map": "frequency:hash_counts.npy", "hash_seed": 7}


def _train(monkeypatch, capfd, *args):
    """``stem-train *args`` in this process, up to its refusal of an old key (before Hydra or any process group):
    its exit code and what it wrote to stderr."""
    from stem_megatron import train

    monkeypatch.setattr(sys, "argv", ["stem-train", *args])
    with pytest.raises(SystemExit) as exited:
        train.main()
    return exited.value.code, capfd.readouterr().err


def test_an_old_key_is_refused_in_one_line_on_the_command_line_and_in_a_recipe(tmp_path, monkeypatch, capfd):
    """Before Hydra composes the run (whose own error would name only the key missing from ``stem``): an override,
    and a recipe with a ``stem:`` block holding ``optimizer:``, swept or not."""
    code, err = _train(monkeypatch, capfd, "stem.placement=device")
    assert code == 1
    assert err == ("error: stem has no key placement, it is host_tables.placement: write "
                   "host_tables.placement=device\n"), err
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "old.yaml").write_text("# @package _global_\nstem:\n  table_init: xavier\n"
                                                      "  optimizer: dense\n")
    monkeypatch.chdir(tmp_path)
    code, err = _train(monkeypatch, capfd, "-m", f"hydra.searchpath=[file://{tmp_path}]", "+experiment=old",
                       "stem.ratio=1/3,full")
    assert code == 1
    assert err == ("error: stem has no key optimizer, it is host_tables.optimizer: recipe experiment/old "
                   "sets it under stem:, set it under host_tables: instead\n"), err
    assert not (tmp_path / "runs").exists()  # no job started


@pytest.mark.parametrize("argv, line", [
    (["+stem.hash_seed=3"], "stem has no key hash_seed, it is hash_moe.hash_seed: write +hash_moe.hash_seed=3"),
    (["-m", "stem.ratio=1/3,full", "stem.cache_rows=4,8"], "stem has no key cache_rows, it is "
                                                           "host_tables.cache_rows: write host_tables.cache_rows=4,8"),
    (["stem={placement: device}"], "stem has no key placement, it is host_tables.placement: the command line sets "
                                   "it under stem:, set it under host_tables: instead"),
    (["-m", "hydra.searchpath=[file://RECIPES]", "variant=stem_1_3,old_moe"],  # the second choice of a sweep
     "stem has no key num_experts, it is hash_moe.num_experts: recipe variant/old_moe sets it under stem:, set it "
     "under hash_moe: instead"),
])
def test_every_form_of_an_old_key_is_refused(argv, line, tmp_path):
    (tmp_path / "variant").mkdir()
    (tmp_path / "variant" / "old_moe.yaml").write_text("# @package stem\nvariant: hash_moe\nnum_experts: 8\n")
    with pytest.raises(ConfigError) as refused:
        refuse_moved_keys([arg.replace("RECIPES", str(tmp_path)) for arg in argv])
    assert str(refused.value) == line


def test_sweeps_and_todays_keys_pass_and_compose_run_refuses_an_old_key():
    """A ratio sweep (slurm/, docs/cluster.md) and today's keys compose; ``compose_run`` (stem-flops --memory,
    stem-doctor) refuses an old key with the same line."""
    refuse_moved_keys(["-m", "stem.ratio=1/3,1/2,full", "variant=stem_1_3,hash_moe", "train.seed=range(1,3)"])
    refuse_moved_keys(["host_tables.placement=device", "hash_moe.num_experts=8", "+experiment=pretrain_350m"])
    cfg = compose_run(["+experiment=pretrain_350m", "variant=hash_moe"])
    assert (cfg.stem.table_init, cfg.host_tables.clip, cfg.hash_moe.num_experts,
            cfg.hash_moe.expert_ffn_hidden_size) == ("xavier", "separate", 16, 1992)
    with pytest.raises(ConfigError, match=r"^stem has no key shm_dir, it is host_tables\.shm_dir: write "
                                          r"host_tables\.shm_dir=/tmp$"):
        compose_run(["stem.shm_dir=/tmp"])


def test_a_checkpoint_names_its_run_by_the_flat_stem_of_before():
    """The manifest's ``stem`` is the dict every checkpoint of the flat layout wrote (its keys in its order), so one
    saved then resumes under today's settings and a changed moved setting is named by today's key."""
    from stem_megatron.checkpoint import manager
    from stem_megatron.checkpoint.atomic import CheckpointError

    saved = {k: v for k, v in OLD_STEM.items() if k not in ("prefetch_depth", "cache_rows", "shm_dir",
                                                           "host_memory_gib", "overlap_exchange", "overlap_update",
                                                           "read_dtype")}
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
    """A run directory's or export's ``config.json`` with a flat ``stem``: its moved keys land in
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
