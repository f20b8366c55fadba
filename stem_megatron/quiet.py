"""The known-harmless notices of megatron-core and torch, silenced in one place: ``stem_megatron/__init__.py``
calls ``install()`` on the package's import, so every entry point (and each torchrun worker or spawned child,
which imports the package before megatron) starts without them. Each filter names the message and the module
that raises it; any other warning, ours (e.g. ``cpu_compat``'s version notice) or megatron's, still prints.

- "Transformer Engine and Apex are not installed. Falling back to ...": megatron's optimizer and FSDP modules at
  import; torch's optimizers and megatron's local kernels are what runs without them (stem-doctor checks TE on a GPU)
- "Apex is not installed. Falling back to Torch Norm": megatron's layer specs; torch's norms are the ones we use
- "full scope is deprecated": megatron-core warns about its own default ``cuda_graph_scope="full"``
- "absl.logging is not installed": megatron-core's process-grid module at import, where absl-py is absent (a venv
  with the core requirements only, as an offline GPU node's); it logs through the standard logging module instead
- "MimoModelConfig is experimental": megatron-core 0.19 warns when its optimizer imports the multimodal model
  package, which we do not use
- "The .grad attribute of a Tensor that is not a leaf ...": megatron's distributed optimizer probes ``.grad`` of its
  shard views in ``zero_grad`` (they never have one); on the CPU torch reports it, and any other such access, from
  ``cpu_compat``'s function mode (one line, so the default action showed only the first access anyway)
- "`torch.distributed.reduce_scatter_tensor` / `all_gather_into_tensor` is deprecated": megatron's DDP and
  distributed optimizer call them (our code does not); a megatron upgrade's concern, not a run's
- "torch.distributed is disabled ... assuming the intent is to load in a single process" and "The argument order of
  load has been changed": torch's, on every resume, because megatron's dist-checkpointing load passes
  ``no_dist=True`` (each rank reads its own shards, by design) and its storage reader by position
- "Could not determine rank from torch.distributed, RANK, or SLURM_PROCID": megatron's rank-0 logging outside a
  distributed job (stem-preprocess opening the datasets it joins), where rank 0 is what it is
- log records, by logger and message start: "GPTModel IS DEPRECATED" (megatron-core 0.19 asks new code to use
  ``HybridModel``; ``GPTModel`` is supported and still megatron's GPT, docs/ARCHITECTURE.md), "MCore's async save is
  deprecated" (megatron's synchronous ``dist_checkpointing.save`` runs through its own deprecated async path), and
  torch's "No CUDA runtime is found" (torch's CUDA build on a machine without a GPU, when DeepSpeed loads its CPU Adam
  op: that op builds with no CUDA)
- "... it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1": megatron's TP linear
  layers; it orders CUDA streams, so only runs on the CPU drop it (``install_cpu``, from ``cpu_compat.enable``);
  slurm/_launch.sh sets the variable for GPU jobs at TP > 1

Megatron's INFO log records (dataset and DDP configuration dumps) are held back by the Hydra job logging of
``recipes/hydra/job_logging/stem.yaml``, not here: a user turns them on from the command line.
"""

import logging
import warnings

_WARNINGS = (  # (message, category, module): regular expressions matched at the start, as ``-W`` does
    (r"Transformer Engine and Apex are not installed\. Falling back to ", UserWarning, r"megatron\.core\."),
    (r"Apex is not installed\. Falling back to Torch Norm", UserWarning, r"megatron\.core\."),
    (r"full scope is deprecated\. Use empty cuda_graph_modules", UserWarning,
     r"megatron\.core\.transformer\.transformer_config$"),
    (r"absl\.logging is not installed\. Using logging\.getLogger", UserWarning, r"megatron\.core\.hyper_comm_grid$"),
    (r"MimoModelConfig is experimental", UserWarning, r"megatron\.core\.models\.mimo\."),
    (r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed", UserWarning,
     r"(megatron\.core\.optimizer\.optimizer|stem_megatron\.cpu_compat)$"),
    (r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated", FutureWarning,
     r"torch\.distributed\.c10d_logger$"),
    (r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a single "
     r"process", UserWarning, r"torch\.distributed\.checkpoint\.utils$"),
    (r"The argument order of load has been changed", UserWarning, r"torch\.distributed\.checkpoint\.logger$"),
    (r"Could not determine rank from torch\.distributed, RANK, or SLURM_PROCID", UserWarning,
     r"megatron\.core\._rank_utils$"),
)
_CPU_ONLY_WARNINGS = (
    (r"When using (async grad allreduce|sequence parallelism) it is recommended to set the environment variable "
     r"CUDA_DEVICE_MAX_CONNECTIONS", UserWarning, r"megatron\.core\.tensor_parallel\.layers$"),
)
LOG_RECORDS = {  # logger: the start of the messages it drops
    "megatron.core.models.gpt.gpt_model": "GPTModel IS DEPRECATED",
    "megatron.core.dist_checkpointing.strategies.torch": "MCore's async save is deprecated",
    "torch.utils.cpp_extension": "No CUDA runtime is found",
}


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def install() -> None:
    """Adds the filters above (idempotent)."""
    for message, category, module in _WARNINGS:
        warnings.filterwarnings("ignore", message, category, module)
    for name, prefix in LOG_RECORDS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropPrefix) for f in logger.filters):
            logger.addFilter(_DropPrefix(prefix))


def install_cpu() -> None:
    """Adds the filters of notices about CUDA that mean nothing on the CPU (idempotent)."""
    for message, category, module in _CPU_ONLY_WARNINGS:
        warnings.filterwarnings("ignore", message, category, module)
