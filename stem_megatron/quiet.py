"""The known-harmless notices of megatron-core and torch, silenced in one place: ``stem_megatron/__init__.py``
calls ``install()`` on the package's import, so every entry point (and each torchrun worker or spawned child,
which imports the package before megatron) starts without them. Each filter names the message and the module
that raises it; any other warning, ours (e.g. ``cpu_compat``'s version notice) or megatron's, still prints.

- "Transformer Engine and Apex are not installed. Falling back to ...": megatron's optimizer and FSDP modules at
  import; torch's optimizers and megatron's local kernels are what runs without them (stem-doctor checks TE on a GPU)
- "Apex is not installed. Falling back to Torch Norm": megatron's layer specs; torch's norms are the ones we use
- "full scope is deprecated": megatron-core 0.16.1 warns about its own default ``cuda_graph_scope="full"``
- "The .grad attribute of a Tensor that is not a leaf ...": megatron's distributed optimizer probes ``.grad`` of its
  shard views in ``zero_grad`` (they never have one); on the CPU torch reports it, and any other such access, from
  ``cpu_compat``'s function mode (one line, so the default action showed only the first access anyway)
- "`torch.distributed.reduce_scatter_tensor` / `all_gather_into_tensor` is deprecated": megatron's DDP and
  distributed optimizer call them (our code does not); a megatron upgrade's concern, not a run's
- the log record "Unknown MLP type: ... Using default kwargs." (``megatron.core.transformer.transformer_layer``):
  megatron does not know our STEM MLP spec by type, once per STEM layer; the default kwargs are the right ones
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
    (r"full scope is deprecated\. Use empty cuda_graph_scope", UserWarning,
     r"megatron\.core\.transformer\.transformer_config$"),
    (r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed", UserWarning,
     r"(megatron\.core\.optimizer\.optimizer|stem_megatron\.cpu_compat)$"),
    (r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated", FutureWarning,
     r"torch\.distributed\.c10d_logger$"),
)
_CPU_ONLY_WARNINGS = (
    (r"When using (async grad allreduce|sequence parallelism) it is recommended to set the environment variable "
     r"CUDA_DEVICE_MAX_CONNECTIONS", UserWarning, r"megatron\.core\.tensor_parallel\.layers$"),
)
MLP_LOGGER = "megatron.core.transformer.transformer_layer"


def _keep(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Unknown MLP type: ")


def install() -> None:
    """Adds the filters above (idempotent)."""
    for message, category, module in _WARNINGS:
        warnings.filterwarnings("ignore", message, category, module)
    logging.getLogger(MLP_LOGGER).addFilter(_keep)


def install_cpu() -> None:
    """Adds the filters of notices about CUDA that mean nothing on the CPU (idempotent)."""
    for message, category, module in _CPU_ONLY_WARNINGS:
        warnings.filterwarnings("ignore", message, category, module)
