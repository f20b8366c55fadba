"""What a run's config fixes that several layers ask: where the STEM tables live, and a step's micro-batches.

Answered here, below ``config.py`` (whose ``validate`` asks it too), so the trainer, the host tables, the memory plan
and the run summary ask these functions instead of comparing ``host_tables.placement`` or dividing the batch. ``cfg``
is a ``RunConfig`` (not imported: ``config.py`` imports this module).
"""

from __future__ import annotations

TABLELESS = ("dense", "hash_moe")  # variants without STEM tables


def tables_on_host(cfg) -> bool:
    """The STEM tables live in host memory (``host_tables/``): a STEM variant with ``host_tables.placement=host``."""
    return cfg.stem.variant not in TABLELESS and cfg.host_tables.placement == "host"


def tables_on_device(cfg) -> bool:
    """The STEM tables are the model's parameters on the device (``model/device_table.py``): a STEM variant with
    ``host_tables.placement=device``."""
    return cfg.stem.variant not in TABLELESS and not tables_on_host(cfg)


def micro_batches_per_step(cfg, dp: int) -> int:
    """A training step's micro-batches on each of ``dp`` DP ranks (``config.validate`` checks that they divide)."""
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
