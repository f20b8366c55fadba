"""Typed run configuration and its validation.

The dataclasses are Hydra structured configs (``recipes/`` fills them); ``validate`` runs before any
process group starts, so a bad field fails in a second with a message that names it and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from stem_megatron.data.blend import expand_blend
from stem_megatron.data.integrity import data_config_problem
from stem_megatron.layer_plan import RATIOS, VARIANTS, stem_layer_indices
from stem_megatron.run_plan import tables_on_device, tables_on_host
from stem_megatron.setup_check import corpus_problem
from stem_megatron.table_state import StateSpec


class ConfigError(ValueError):
    """A configuration field is invalid; the message names the field and how to fix it."""


@dataclass
class ModelConfig:
    """Transformer shape (megatron-core GPTModel, RMSNorm, SwiGLU, RoPE, untied embeddings)."""

    name: str = "tiny"
    num_layers: int = 4
    hidden_size: int = 64
    ffn_hidden_size: int = 192
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    vocab_size: int = 4096
    seq_length: int = 64
    rotary_base: int = 10000
    norm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    rope_scaling_factor: Optional[float] = None  # Llama 3's RoPE scaling (as megatron applies it); None: none


@dataclass
class STEMConfig:
    """Which FFN layers are replaced, and by what (paper §2.2, §2.3, Table 3)."""

    variant: str = "stem"  # dense | stem | stem_dagger | stem_gate | hash_moe
    ratio: str = "1/3"  # 0 | 1/3 | 1/2 | full
    layers: Optional[list[int]] = None  # explicit 0-based layer indices; overrides ratio
    # U_l ~ N(0, std) (docs/recipes.md): scaled: std = init_method_std * sqrt(hidden_size), the scale of the W_u x
    # entries U_l[t] replaces | xavier: std = sqrt(2 / (vocab_size + ffn_hidden_size)), as the released code |
    # from_dense (with checkpoint.init_from_hf): U_l[t] = W_u E[x_l | t], the dense layer's up-projection of its FFN
    # input averaged over token t's occurrences in the training mix, data.blend (docs/checkpoints.md)
    table_init: str = "scaled"
    table_init_std: Optional[float] = None  # overrides the std of scaled or xavier
    calibration_tokens: Optional[int] = None  # from_dense: tokens of the calibration pass (None: one pass over all)
    calibration_gib: float = 4.0  # from_dense: device GiB of the pass's sums; layers beyond it: more passes


@dataclass
class HostTablesConfig:
    """Where the STEM tables live and how they are trained (host_tables/, docs/host_tables.md)."""

    placement: str = "host"  # host: node-shared host memory + prefetch + CPU Adam | device: a parameter
    optimizer: str = "lazy"  # host tables: lazy (touched rows) | dense (every row, the paper's AdamW)
    # gradient clipping to train.clip_grad (docs/recipes.md): global: one norm over the dense and STEM table
    # grads together | separate: dense grads by their own norm, the tables' by theirs (the released code)
    clip: str = "global"
    prefetch_depth: int = 2  # micro-batches fetched ahead (bounded queue)
    cache_rows: int = 0  # hot rows per table kept on the compute device (0: no cache)
    # host tables: rows per table and rank resident on the compute device with their Adam state, updated there (at
    # DP > 1 the rows the rank owns; host_tables/working_set.py; 0: none, rows fetched and updated on the host)
    resident_rows: int = 0
    shm_dir: str = "/dev/shm"  # host tables: the node's shared-memory (tmpfs) directory they are mapped from
    # host tables: GiB of memory a node can give them, where the machine's own figure understates it (a VM whose
    # RAM grows as it is used); None: MemAvailable, bounded by a cgroup memory limit (host_tables/node.py)
    host_memory_gib: Optional[float] = None
    wire_dtype: str = "fp32"  # host tables: row gradients sent to their owner node in fp32 (exact) | bf16
    read_dtype: str = "fp32"  # host tables: each node's copy of the tables fp32 | bf16 (fp32 masters at the owners)
    state_dtype: str = "fp32"  # host tables' Adam moments fp32 | bf16, stochastically rounded (docs/lean_tables.md)
    second_moment: str = "element"  # host tables' Adam second moment per element | row (one fp32 a d_ff/8 columns)
    master_dtype: str = "fp32"  # host tables' masters fp32 | bf16: the bf16 read copy, stochastically rounded
    # host tables: send a layer's row gradients to their owners while backward runs through the earlier layers
    overlap_exchange: bool = True
    # host tables: CPU Adam on the rows the next step reads first, on the others while the next step runs
    overlap_update: bool = True


@dataclass
class HashMoEConfig:
    """The Hash-Layer baseline (stem.variant=hash_moe, Roller et al. 2021): experts per replaced layer, their d_ff,
    the token->expert map."""

    num_experts: int = 16
    expert_ffn_hidden_size: Optional[int] = None  # None: model.ffn_hidden_size
    hash_map: str = "random"  # random | frequency:<token counts .npy>
    hash_seed: int = 1234


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1  # Hash-MoE experts spread over this many ranks (no expert TP)
    sequence_parallel: bool = False  # megatron sequence parallelism (required by its MoE layer with TP)
    use_distributed_optimizer: bool = True
    # elements per DDP gradient bucket (None: one bucket a buffer, or megatron's default with overlap_grad_reduce)
    ddp_bucket_size: Optional[int] = None
    # megatron DDP: each bucket's gradient reduce(-scatter) issued from backward as soon as its last gradient is in,
    # and (distributed optimizer) the updated weights' all-gather issued bucket by bucket from the next forward
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False


@dataclass
class TrainConfig:
    """Optimizer and schedule (paper Table 2 defaults: AdamW 0.9/0.95, wd 0.1, min lr 0.1x peak)."""

    steps: int = 50
    micro_batch_size: int = 4
    global_batch_size: int = 8
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_ratio: float = 0.01
    decay_style: str = "cosine"  # cosine | linear
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    clip_grad: float = 1.0
    seed: int = 1234
    log_interval: int = 1
    exit_after_steps: Optional[int] = None  # stop (after saving a checkpoint) once this job ran this many steps
    stop_deadline_s: float = 110.0  # after SIGTERM/SIGUSR1: exit at once if the step and its save take longer
    eval_interval: int = 0  # validation loss every this many steps (0: after the last step only)
    eval_iters: int = 2  # global batches of the validation split per evaluation (0: no validation)
    max_skipped_steps: int = 10  # a run stops after this many non-finite steps in a row (each skipped, not applied)
    skip_steps: list = field(default_factory=list)  # steps not trained on, e.g. [2300-2500] (skip_range)


@dataclass
class DataConfig:
    """Tokenized data: ``dir`` holds ``tokenizer.json`` and indexed datasets (``stem-preprocess``, or
    ``python -m stem_megatron.data.corpus`` for the demo's train/valid split); megatron packs, shuffles
    and blends them (``data/datasets.py``). Prefixes are relative to ``dir`` unless absolute."""

    dir: str = "data_cache/python-doc"
    vocab_size: int = 4096  # the tokenizer's; model.vocab_size must cover it
    blend: Optional[list] = None  # [[weight, prefix | directory | glob], ...] (data/blend.py); None: [[1, train]]
    valid_prefixes: Optional[list[str]] = None  # None: [valid]
    valid_samples: Optional[int] = None  # None: one pass over the validation prefixes
    reset_position_ids: bool = False  # positions restart after every EOD
    reset_attention_mask: bool = False  # tokens attend only within their own document
    eod_mask_loss: bool = False  # no loss on EOD targets
    cache_dir: Optional[str] = None  # megatron's index cache, shared by all ranks; None: <dir>/index_cache

    def train_blend(self) -> list[tuple[float, str]]:
        """``(weight, prefix path)`` pairs of the training mix, directories and globs expanded."""
        return expand_blend(self.blend or [[1, "train"]], self.dir)

    def valid_prefix_paths(self) -> list[str]:
        return [str(Path(self.dir) / prefix) for prefix in (self.valid_prefixes or ["valid"])]  # absolute: as it is


@dataclass
class LoggingConfig:
    """Loss-spike detection, W&B tracking and MFU (docs/tracking.md)."""

    wandb: bool = False  # one W&B run per job, written by rank 0
    wandb_mode: str = "offline"  # offline (sync later) | online | disabled
    project: str = "stem-megatron"
    entity: Optional[str] = None
    run_name: Optional[str] = None  # None: <model>-<variant>-<ratio>
    group: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    spike_window: int = 100  # non-spike losses the spike statistics cover
    spike_k: float = 4.0  # a spike exceeds the baseline by this many standard deviations
    spike_warmup: int = 20  # losses needed before finite spikes are flagged
    spike_detrend: bool = True  # quadratic-fit baseline instead of the window mean (see docs/tracking.md)
    peak_tflops: Optional[float] = None  # one device's peak for MFU; None: from the GPU name (none on CPU)
    # wrap this step in torch.profiler; rank 0 writes <out_dir>/profile_step<N>.txt (the top ops by self device and
    # CPU time) and profile_step<N>.json (ops, peak memory so far); None: no profiling (docs/gpu.md)
    profile_step: Optional[int] = None
    # this step's collectives on every rank (thread, group, op, order); rank 0 writes
    # <out_dir>/collective_audit_step<N>.json and says whether the ranks' orders agree (training/collective_audit.py)
    collective_audit: Optional[int] = None
    # this step's synchronising CUDA calls on every rank (torch's sync debug mode: thread, call site, count); each
    # rank writes <out_dir>/sync_audit_step<N>_rank<r>.txt (training/sync_audit.py; GPU runs)
    sync_audit: Optional[int] = None


@dataclass
class CheckpointConfig:
    """Where and how often to save, what to resume from (docs/checkpoints.md)."""

    dir: Optional[str] = None  # None: <out_dir>/checkpoints
    save_interval: int = 0  # save every this many steps (0: only after the last step)
    save_interval_min: float = 0.0  # also save once this many minutes passed since the last save (0: not by time)
    save: bool = True  # false: no checkpoint at all, not even after the last step (benchmarks)
    keep: int = 2  # complete checkpoints kept (0: all)
    keep_every: int = 0  # also keep those whose step is a multiple of this (milestones; 0: none)
    resume: bool = True  # continue from <dir>/latest when it exists
    fallback: bool = True  # a damaged newest checkpoint is reported and the newest intact one used (false: refuse)
    load: Optional[str] = None  # resume from this checkpoint (a step dir or a root with `latest`) instead
    init_from: Optional[str] = None  # new run whose weights and STEM tables come from this checkpoint
    init_from_hf: Optional[str] = None  # new run from a Hugging Face Llama/Qwen2 directory (docs/checkpoints.md)
    init_required: bool = False  # the recipe continues an earlier stage: init_from must be given
    export: Optional[str] = None  # after the last step, write a single-process export here


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    stem: STEMConfig = field(default_factory=STEMConfig)
    host_tables: HostTablesConfig = field(default_factory=HostTablesConfig)
    hash_moe: HashMoEConfig = field(default_factory=HashMoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    out_dir: str = "runs/default"


def to_run_config(cfg) -> RunConfig:
    """The typed ``RunConfig`` of a Hydra/OmegaConf config or a ``dataclasses.asdict`` dict (unknown keys
    and wrong types fail)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), cfg))


def skip_range(entry) -> tuple[int, int]:
    """A ``train.skip_steps`` entry (a step, or ``"first-last"``) as an inclusive range: steps whose batches are not
    trained on (a rollback past a loss spike); each counts as a skipped step (the schedule advances, nothing is
    updated)."""
    first, _, last = str(entry).partition("-")
    try:
        first, last = int(first), int(last or first)
    except ValueError:
        raise ConfigError(f"train.skip_steps: {entry!r} is not a step or a range first-last (e.g. 2300-2500)") from None
    _check(1 <= first <= last, "train.skip_steps", f"{entry!r}: a range first-last with 1 <= first <= last")
    return first, last


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{field_name}: {message}")


def validate(cfg: RunConfig, world_size: int) -> int:
    """Check every field that would otherwise fail deep inside megatron; returns the DP size."""
    dp = validate_layout(cfg, world_size)
    h, c = cfg.host_tables, cfg.checkpoint
    _check(not tables_on_host(cfg) or Path(h.shm_dir).is_dir(), "host_tables.shm_dir",
           f"{h.shm_dir} is not a directory: give a tmpfs directory every rank of a node sees (e.g. /dev/shm)")
    _check(h.host_memory_gib is None or h.host_memory_gib > 0, "host_tables.host_memory_gib",
           f"{h.host_memory_gib} GiB: give the memory a node can give its tables, or null to read it from the machine")
    if cfg.stem.variant == "hash_moe" and cfg.parallel.tensor_model_parallel_size > 1:
        _check(torch.cuda.is_available() and find_spec("transformer_engine") is not None,
               "parallel.tensor_model_parallel_size",
               "Hash-MoE with TP>1 needs sequence parallelism, which megatron-core's layers support only with "
               "Transformer Engine's norms (a GPU with TE); elsewhere use expert parallelism with TP=1")
    _check(cfg.logging.sync_audit is None or torch.cuda.is_available(), "logging.sync_audit",
           "it counts the step's synchronising CUDA calls, and this run has no GPU: set it on a GPU run, or null")
    problem = corpus_problem(Path(cfg.data.dir))
    _check(problem is None, "data.dir", problem)
    problem = data_config_problem(cfg.data)
    _check(problem is None, *(problem or ("", "")))
    for name, path in (("checkpoint.load", c.load), ("checkpoint.init_from", c.init_from)):
        _check(path is None or Path(path).exists(), name, f"{path} does not exist")
    return dp


def validate_layout(cfg: RunConfig, world_size: int) -> int:
    """The checks of ``validate`` that read no file and no device: the fields and their fit to a world of
    ``world_size`` ranks (also before launch, on any machine: ``stem-flops --memory``); returns the DP size."""
    m, s, h, p, t = cfg.model, cfg.stem, cfg.host_tables, cfg.parallel, cfg.train
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    _check(tp >= 1 and pp >= 1, "parallel", "tensor/pipeline sizes must be >= 1")
    _check(world_size % (tp * pp) == 0, "parallel", f"world size {world_size} is not divisible by tp*pp = {tp * pp}; "
           f"launch tp*pp*dp processes (e.g. torchrun --nproc_per_node {tp * pp})")
    dp = world_size // (tp * pp)
    groups = m.num_query_groups or m.num_attention_heads
    _check(m.hidden_size % m.num_attention_heads == 0, "model.hidden_size",
           f"{m.hidden_size} is not divisible by model.num_attention_heads={m.num_attention_heads}")
    _check(m.num_attention_heads % tp == 0, "model.num_attention_heads",
           f"{m.num_attention_heads} heads are not divisible by tensor_model_parallel_size={tp}")
    _check(m.num_attention_heads % groups == 0, "model.num_query_groups",
           f"{groups} does not divide num_attention_heads={m.num_attention_heads}")
    _check(groups % tp == 0, "model.num_query_groups",
           f"{groups} query groups are not divisible by tensor_model_parallel_size={tp}")
    _check(m.ffn_hidden_size % tp == 0, "model.ffn_hidden_size",
           f"d_ff={m.ffn_hidden_size} is not divisible by tensor_model_parallel_size={tp}")
    _check(m.vocab_size % tp == 0, "model.vocab_size",
           f"{m.vocab_size} is not divisible by tensor_model_parallel_size={tp}")
    _check(m.num_layers % pp == 0, "model.num_layers",
           f"{m.num_layers} layers are not divisible by pipeline_model_parallel_size={pp}")
    _check(s.variant in VARIANTS, "stem.variant", f"{s.variant!r} is not one of {sorted(VARIANTS)}")
    _check(s.ratio in RATIOS, "stem.ratio", f"{s.ratio!r} is not one of {sorted(RATIOS)}")
    _check(h.placement in ("host", "device"), "host_tables.placement", f"{h.placement!r} is not 'host' or 'device'")
    _check(h.optimizer in ("lazy", "dense"), "host_tables.optimizer", f"{h.optimizer!r} is not 'lazy' or 'dense'")
    _check(h.clip in ("global", "separate"), "host_tables.clip",
           f"{h.clip!r} is not 'global' or 'separate' (docs/recipes.md)")
    _check(h.clip == "global" or not tables_on_device(cfg), "host_tables.clip", "separate clipping needs "
           "host_tables.placement=host: on the device the tables are parameters of megatron's optimizer, which clips "
           "all its parameters by one norm; set host_tables.placement=host or host_tables.clip=global")
    _check(h.wire_dtype in ("fp32", "bf16"), "host_tables.wire_dtype", f"{h.wire_dtype!r} is not 'fp32' or 'bf16'")
    _check(h.read_dtype in ("fp32", "bf16"), "host_tables.read_dtype", f"{h.read_dtype!r} is not 'fp32' or 'bf16'")
    problem = StateSpec.problem(h)  # the tables' row state (docs/lean_tables.md)
    _check(problem is None, *(problem or ("", "")))
    _check(s.table_init in ("scaled", "xavier", "from_dense"), "stem.table_init",
           f"{s.table_init!r} is not 'scaled', 'xavier' or 'from_dense' (docs/recipes.md)")
    _check(s.table_init != "from_dense" or cfg.checkpoint.init_from_hf, "stem.table_init", "from_dense reads a dense "
           "model's up-projections: set checkpoint.init_from_hf=<a Hugging Face model directory>, or table_init=scaled")
    _check((s.calibration_tokens or 1) >= 1, "stem.calibration_tokens", "must be >= 1 or null (one pass over all)")
    _check(s.calibration_gib > 0, "stem.calibration_gib", "must be > 0 (device GiB of the calibration's sums)")
    _check(s.table_init_std is None or s.table_init_std > 0, "stem.table_init_std", "must be > 0 or null")
    _check(h.prefetch_depth >= 1, "host_tables.prefetch_depth", "must be >= 1")
    if h.resident_rows and s.variant not in ("dense", "hash_moe"):
        _check(tables_on_host(cfg), "host_tables.resident_rows", "a working set holds host tables' rows: set "
               "host_tables.placement=host or host_tables.resident_rows=0")
        _check(not h.cache_rows, "host_tables.cache_rows", "the working set (host_tables.resident_rows) replaces the "
               "hot-row cache: set host_tables.cache_rows=0")
    ep = p.expert_model_parallel_size
    _check(ep >= 1 and (world_size // pp) % ep == 0, "parallel.expert_model_parallel_size",
           f"{ep} does not divide the {world_size // pp} ranks of a pipeline stage")
    if p.sequence_parallel:
        _check(m.seq_length % tp == 0, "parallel.sequence_parallel",
               f"model.seq_length={m.seq_length} is not divisible by tensor_model_parallel_size={tp}")
    if s.variant == "hash_moe" and tp > 1:
        _check(p.sequence_parallel, "parallel.sequence_parallel",
               "megatron's MoE layer with tensor parallelism needs sequence parallelism: set it to true")
    if s.variant == "hash_moe":
        e = cfg.hash_moe
        _check(e.num_experts >= 1 and e.num_experts % ep == 0, "hash_moe.num_experts",
               f"{e.num_experts} experts are not divisible by expert_model_parallel_size={ep}")
        _check(e.hash_map == "random" or e.hash_map.startswith("frequency:"), "hash_moe.hash_map",
               f"{e.hash_map!r} is not 'random' or 'frequency:<token counts .npy>'")
    else:
        _check(ep == 1, "parallel.expert_model_parallel_size", "expert parallelism needs stem.variant=hash_moe")
    try:
        stem_layer_indices(m.num_layers, s.ratio, s.layers)
    except ValueError as e:
        raise ConfigError(f"stem.layers: {e}") from None
    _check(m.vocab_size >= cfg.data.vocab_size, "model.vocab_size",
           f"{m.vocab_size} is smaller than the tokenizer's data.vocab_size={cfg.data.vocab_size}")
    per_step = t.micro_batch_size * dp
    _check(t.global_batch_size % per_step == 0, "train.global_batch_size",
           f"{t.global_batch_size} is not divisible by micro_batch_size*dp = {per_step}")
    _check(t.decay_style in ("cosine", "linear"), "train.decay_style",
           f"{t.decay_style!r} is not 'cosine' or 'linear'")
    _check(t.steps >= 1, "train.steps", "must be >= 1")
    _check(t.exit_after_steps is None or t.exit_after_steps >= 1, "train.exit_after_steps", "must be >= 1")
    _check(t.eval_interval >= 0 and t.eval_iters >= 0, "train.eval_interval",
           "train.eval_interval and train.eval_iters must be >= 0")
    _check(0.0 <= t.min_lr_ratio <= 1.0, "train.min_lr_ratio", "must be in [0, 1]")
    c = cfg.checkpoint
    _check(c.save_interval >= 0, "checkpoint.save_interval", "must be >= 0 (0: save after the last step)")
    _check(c.save or not c.save_interval, "checkpoint.save_interval",
           f"{c.save_interval} asks for checkpoints, but checkpoint.save=false writes none: set one or the other")
    _check(cfg.parallel.ddp_bucket_size is None or cfg.parallel.ddp_bucket_size >= 1, "parallel.ddp_bucket_size",
           "must be >= 1 element (or null: one bucket)")
    _check(not cfg.parallel.overlap_param_gather or (cfg.parallel.overlap_grad_reduce
                                                     and cfg.parallel.use_distributed_optimizer),
           "parallel.overlap_param_gather", "needs parallel.overlap_grad_reduce=true and "
           "parallel.use_distributed_optimizer=true (megatron's all-gather of the weights' DP shards)")
    _check(c.save_interval_min >= 0, "checkpoint.save_interval_min", "must be >= 0 (0: not by time)")
    _check(t.stop_deadline_s > 0, "train.stop_deadline_s", "must be > 0 (seconds from a stop signal to exiting)")
    _check(c.save or t.exit_after_steps is None, "train.exit_after_steps", "stops a job to continue later from its "
           "checkpoint, but checkpoint.save=false writes none: set checkpoint.save=true")
    for name, value in (("checkpoint.keep", c.keep), ("checkpoint.keep_every", c.keep_every),
                        ("train.max_skipped_steps", t.max_skipped_steps), ("host_tables.cache_rows", h.cache_rows),
                        ("host_tables.resident_rows", h.resident_rows)):
        _check(value >= 0, name, "must be >= 0")
    [skip_range(entry) for entry in t.skip_steps]  # each entry a step or a range
    _check(not c.export or not Path(c.export).exists(), "checkpoint.export", f"{c.export} already exists, and the "
           "export after the last step would not replace it: remove it or choose another directory")
    _check(not (c.load and c.init_from), "checkpoint.init_from", "set either checkpoint.load (resume a run) or "
           "checkpoint.init_from (start a new run from its weights), not both")
    _check(not (c.init_from_hf and (c.load or c.init_from)), "checkpoint.init_from_hf",
           "a run starts from one source: set checkpoint.init_from_hf or checkpoint.init_from/load, not both")
    _check(c.init_from or c.load or not c.init_required, "checkpoint.init_from",
           "this recipe continues an earlier training stage: set checkpoint.init_from=<that run's checkpoints "
           "directory or one of its step_* checkpoints>")
    lg = cfg.logging
    _check(lg.wandb_mode in ("offline", "online", "disabled"), "logging.wandb_mode",
           f"{lg.wandb_mode!r} is not 'offline', 'online' or 'disabled'")
    _check(lg.spike_k > 0, "logging.spike_k", "must be > 0")
    for name in ("profile_step", "collective_audit", "sync_audit"):
        step = getattr(lg, name)
        _check(step is None or 1 <= step <= t.steps, f"logging.{name}",
               f"{step} is not a step of this run: give one in 1..train.steps={t.steps}, or null")
    lowest = 5 if lg.spike_detrend else 2
    _check(lowest <= lg.spike_warmup <= lg.spike_window, "logging.spike_warmup",
           f"{lg.spike_warmup} is not in [{lowest}, logging.spike_window={lg.spike_window}]")
    return dp
