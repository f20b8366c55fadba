"""The weights as the last optimizer step left them, for whoever reads them between steps.

With ``parallel.overlap_param_gather`` megatron's distributed optimizer leaves each rank's weights updated only in
its own DP shard; the all-gather of the others waits for the next forward (megatron's forward pre-hooks, bucket by
bucket). A checkpoint or an export written in between would hold stale weights (a resume would not show it: it loads
the optimizer's masters over them; ``checkpoint.init_from`` and every export reader would).
"""

from __future__ import annotations

from megatron.core.distributed import DistributedDataParallel


def current_weights(model: DistributedDataParallel) -> None:
    """Gathers the weights' DP shards now if the next forward has not (megatron's own synchronous all-gather,
    collective over DP); that forward then finds them gathered. Nothing to do without the overlap."""
    if model.ddp_config.overlap_param_gather:
        model.start_param_sync(force_sync=True)
