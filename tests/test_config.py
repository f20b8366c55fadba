"""Bad configuration fails before any process group starts, with a message naming the field."""

import pytest
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from stem_megatron.config import (
    CheckpointConfig,
    ConfigError,
    HostTablesConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    STEMConfig,
    to_run_config,
    validate,
)
from stem_megatron.layer_plan import stem_layer_indices
from stem_megatron.recipes import RECIPES
from stem_megatron.training.loop import run


def _cfg(**parts):
    return RunConfig(**parts)


BAD = [
    ("model.ffn_hidden_size", dict(model=ModelConfig(ffn_hidden_size=190)), 4, dict(tensor_model_parallel_size=4)),
    ("model.num_attention_heads", dict(model=ModelConfig(num_attention_heads=6, hidden_size=96)), 4,
     dict(tensor_model_parallel_size=4)),
    ("model.num_layers", dict(model=ModelConfig(num_layers=5)), 2, dict(pipeline_model_parallel_size=2)),
    ("stem.ratio", dict(stem=STEMConfig(ratio="1/4")), 1, {}),
    ("stem.layers", dict(stem=STEMConfig(layers=[1, 4])), 1, {}),
    ("stem.table_init", dict(stem=STEMConfig(table_init="normal")), 1, {}),
    ("stem.table_init_std", dict(stem=STEMConfig(table_init_std=0.0)), 1, {}),
    ("host_tables.clip", dict(host_tables=HostTablesConfig(clip="per_layer")), 1, {}),
    # the working set replaces the hot-row cache
    ("host_tables.cache_rows", dict(host_tables=HostTablesConfig(resident_rows=64, cache_rows=8)), 1, {}),
    ("host_tables.host_memory_gib", dict(host_tables=HostTablesConfig(host_memory_gib=0)), 1, {}),
    ("parallel", dict(), 3, dict(tensor_model_parallel_size=2)),
    ("parallel.overlap_param_gather", dict(), 1, dict(overlap_param_gather=True)),
    ("train.global_batch_size", dict(), 2, {}),
]


@pytest.mark.parametrize("field,parts,world,par", BAD, ids=[b[0] for b in BAD])
def test_bad_config_names_the_field(field, parts, world, par, monkeypatch):
    cfg = _cfg(parallel=ParallelConfig(**par), **parts)
    if field == "train.global_batch_size":
        cfg.train.global_batch_size, cfg.train.micro_batch_size = 6, 4
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(cfg, world)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        run(cfg)  # the entry point validates first ...
    assert not dist.is_initialized()  # ... so no process group was started


def test_separate_clip_needs_host_tables():
    """megatron's optimizer clips the on-device tables with every other parameter by one norm."""
    with pytest.raises(ConfigError, match=r"host_tables\.clip: .*set host_tables\.placement=host or "
                                          r"host_tables\.clip=global"):
        validate(_cfg(host_tables=HostTablesConfig(placement="device", clip="separate")), 1)
    assert validate(_cfg(host_tables=HostTablesConfig(placement="host", clip="separate")), 1) == 1
    assert validate(_cfg(stem=STEMConfig(variant="dense"), host_tables=HostTablesConfig(placement="device",
                                                                                        clip="separate")), 1) == 1


def test_shm_dir_is_checked_where_tables_live_in_host_memory(tmp_path):
    """The tables in host memory are mapped from host_tables.shm_dir; a run without them needs none."""
    missing = str(tmp_path / "no_shm")
    with pytest.raises(ConfigError, match=r"host_tables\.shm_dir: .*no_shm is not a directory"):
        validate(_cfg(host_tables=HostTablesConfig(shm_dir=missing)), 1)
    assert validate(_cfg(stem=STEMConfig(variant="dense"), host_tables=HostTablesConfig(shm_dir=missing)), 1) == 1
    assert validate(_cfg(host_tables=HostTablesConfig(placement="device", shm_dir=missing)), 1) == 1


def test_an_existing_export_directory_is_refused_before_training(tmp_path):
    """The export is written after the last step and never replaces a directory: said at the start, not then."""
    with pytest.raises(ConfigError, match=r"checkpoint\.export: .* already exists.*remove it or choose another"):
        validate(_cfg(checkpoint=CheckpointConfig(export=str(tmp_path))), 1)
    assert validate(_cfg(checkpoint=CheckpointConfig(export=str(tmp_path / "new"))), 1) == 1


def test_good_config_returns_dp_size():
    assert validate(_cfg(parallel=ParallelConfig(tensor_model_parallel_size=2)), 4) == 2


def test_layer_plan_uniform_intervals():
    assert stem_layer_indices(24, "1/3") == [2, 5, 8, 11, 14, 17, 20, 23]
    assert stem_layer_indices(24, "1/2") == list(range(1, 24, 2))
    assert stem_layer_indices(6, "full") == [1, 2, 3, 4, 5]  # every layer except the first
    assert stem_layer_indices(16, "1/3") == [2, 5, 8, 11, 15]
    assert stem_layer_indices(8, "0") == []
    assert stem_layer_indices(8, "1/3", layers=[7, 0]) == [0, 7]
    with pytest.raises(ValueError, match="out of range"):
        stem_layer_indices(8, "1/3", layers=[8])


def _compose(*overrides):
    with initialize_config_dir(config_dir=RECIPES, version_base=None):
        return compose("train", overrides=list(overrides))


def test_recipes_compose_into_the_typed_schema():
    for variant in ("dense", "stem_1_3", "stem_1_2", "stem_full", "stem_dagger", "stem_gate", "hash_moe"):
        for model in ("tiny", "mobilellm_350m", "llama3.2_1b"):
            cfg = to_run_config(_compose(f"variant={variant}", f"model={model}", "parallel=single"))
            assert isinstance(cfg, RunConfig) and cfg.model.name == model
    assert to_run_config(_compose("variant=stem_full")).stem.ratio == "full"


def test_mistyped_override_fails_at_composition():
    with pytest.raises(ConfigCompositionException, match="model.num_layers=four"):
        _compose("model.num_layers=four")


@pytest.mark.parametrize("experiment, model, lr", [("pretrain_350m", "mobilellm_350m", 2e-3),
                                                   ("pretrain_1b", "llama3.2_1b", 4e-4)])
def test_paper_experiments_compose_and_validate_for_64_gpus(experiment, model, lr):
    cfg = to_run_config(_compose(f"+experiment={experiment}", "variant=stem_1_3"))
    assert cfg.model.name == model and cfg.train.lr == lr and cfg.train.global_batch_size == 512
    assert (cfg.train.adam_beta1, cfg.train.adam_beta2, cfg.train.weight_decay) == (0.9, 0.95, 0.1)
    # as the released code; clip and optimizer also as study v2's ablation found (docs/recipes.md)
    assert (cfg.stem.table_init, cfg.host_tables.clip, cfg.host_tables.optimizer) == ("xavier", "separate", "dense")
    assert validate(cfg, 64) == 64


@pytest.mark.parametrize("experiment, lr, decay, seq, batch, cross_doc", [
    ("midtrain_1b", 3.2e-4, "linear", 4096, 512, False),
    ("context_extend_1b", 1e-5, "cosine", 32768, 64, True)])
def test_later_stages_compose_and_validate(experiment, lr, decay, seq, batch, cross_doc, tmp_path):
    """Table 2's mid-training and context-extension rows; both start from an earlier stage's checkpoint,
    which they require."""
    with pytest.raises(ConfigError, match="checkpoint.init_from: this recipe continues an earlier training stage"):
        validate(to_run_config(_compose(f"+experiment={experiment}", "variant=stem_1_3")), 64)
    cfg = to_run_config(_compose(f"+experiment={experiment}", "variant=stem_1_3", f"checkpoint.init_from={tmp_path}"))
    t = cfg.train
    assert (cfg.model.name, t.lr, t.decay_style, cfg.model.seq_length, t.global_batch_size) == (
        "llama3.2_1b", lr, decay, seq, batch)
    assert cfg.data.reset_attention_mask == cfg.data.reset_position_ids == cross_doc
    if experiment == "midtrain_1b":
        assert [w for w, _ in cfg.data.blend] == [65, 5, 30]
    assert (cfg.host_tables.clip, cfg.host_tables.optimizer) == ("separate", "dense")  # as pretrain_1b
    assert validate(cfg, 64) == 64
