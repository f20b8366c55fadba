"""megatron's and torch's known-harmless notices (``stem_megatron/quiet.py``) stay off a CLI's stderr, and every
other warning still prints. In subprocesses: pytest's own warning filters would hide both."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KNOWN = ("Transformer Engine and Apex are not installed", "Apex is not installed", "full scope is deprecated",
         "absl.logging is not installed", "MimoModelConfig is experimental", "GPTModel IS DEPRECATED",
         "MCore's async save is deprecated", "No CUDA runtime is found",
         "CUDA_DEVICE_MAX_CONNECTIONS")  # the last one once cpu_compat is enabled (CPU runs)


def _stderr(*args: str) -> str:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_cli_starts_without_the_known_notices():
    err = _stderr("-m", "stem_megatron.data.preprocess", "--help")  # imports megatron.core, so its optimizer
    assert not any(notice in err for notice in KNOWN), err


def test_known_notices_are_silenced_and_others_still_print():
    err = _stderr("-c", """
import logging, warnings
from stem_megatron import cpu_compat  # the package first, as in every entry point
from stem_megatron.quiet import LOG_RECORDS
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import get_megatron_optimizer  # imports megatron's multimodal configs
from megatron.core.transformer import TransformerConfig

get_gpt_layer_local_spec()
TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
for name, prefix in LOG_RECORDS.items():
    logging.getLogger(name).warning(prefix + " (as the library words it)")
CUDA_NOTICE = ("When using async grad allreduce it is recommended to set the environment variable "
               "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup")
warnings.warn_explicit(CUDA_NOTICE, UserWarning, "layers.py", 1, module="megatron.core.tensor_parallel.layers")
warnings.warn_explicit("absl.logging is not installed. Using logging.getLogger(__name__) instead. Please install "
                       "absl.logging with `pip install absl-py` to use absl.logging.", UserWarning,
                       "hyper_comm_grid.py", 20, module="megatron.core.hyper_comm_grid")  # a venv without absl-py
cpu_compat.CHECKED_MEGATRON_CORE = "0.0"
cpu_compat.enable()
warnings.warn("a notice nobody listed")
warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning, "ours.py", 1,
                       module="stem_megatron.ours")
warnings.warn_explicit("a megatron notice nobody listed", UserWarning, "optimizer.py", 1,
                       module="megatron.core.optimizer")
warnings.warn_explicit(CUDA_NOTICE, UserWarning, "layers.py", 2, module="megatron.core.tensor_parallel.layers")
logging.getLogger("megatron.core.models.gpt.gpt_model").warning("a megatron log line nobody listed")
""")
    assert err.count("Apex is not installed") == 1, err  # ours.py's, below
    assert err.count("CUDA_DEVICE_MAX_CONNECTIONS") == 1 and "layers.py:1: UserWarning" in err, err  # before enable()
    known = [notice for notice in KNOWN if notice not in ("Apex is not installed", "CUDA_DEVICE_MAX_CONNECTIONS")]
    assert not any(notice in err for notice in known), err
    for expected in ("was checked against megatron-core 0.0", "a notice nobody listed",
                     "ours.py:1: UserWarning: Apex is not installed", "a megatron notice nobody listed",
                     "a megatron log line nobody listed"):
        assert expected in err, (expected, err)


def test_training_logs_hold_back_megatron_info_only():
    """The train config's Hydra job logging (recipes/hydra/job_logging/stem.yaml), applied as Hydra applies it:
    megatron's INFO records (dataset and DDP configuration dumps) stay off stdout, its warnings and other
    libraries' INFO records do not, and the documented override brings megatron's INFO back."""
    script = """
import logging, logging.config, sys
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
import stem_megatron.recipes  # registers run_schema
with initialize_config_dir(config_dir=sys.argv[1], version_base=None):
    cfg = compose("train", overrides=sys.argv[2:], return_hydra_config=True)
logging.config.dictConfig(OmegaConf.to_container(cfg.hydra.job_logging, resolve=True))
logging.getLogger("megatron.core.datasets.blended_megatron_dataset_builder").info("megatron info")
logging.getLogger("megatron.core.distributed").warning("megatron warning")
logging.getLogger("some.library").info("library info")
"""
    def stdout(*overrides):
        proc = subprocess.run([sys.executable, "-c", script, str(ROOT / "recipes"), *overrides], capture_output=True,
                              text=True, cwd=ROOT, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.splitlines()

    assert stdout() == ["megatron warning", "library info"]
    assert stdout("hydra.job_logging.loggers.megatron.level=INFO") == ["megatron info", "megatron warning",
                                                                       "library info"]
