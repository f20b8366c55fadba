"""The distributed optimizer's checkpoints stay exact with several DDP buckets (megatron-core 0.19.2).

megatron pads each bucket of a gradient buffer to a multiple of lcm(DP, 128) elements, and a parameter's place in
the buffer (``param_index_map``) counts that padding. The ``fully_reshardable`` save gathers the optimizer state
(fp32 masters, ``exp_avg``, ``exp_avg_sq``) into one tensor per buffer with the padding between buckets removed,
then slices it at ``param_index_map``'s padded offsets (``sharded_param_state_fully_reshardable``). With one
bucket nothing is removed before any parameter; with more, every parameter after the first bucket is saved from
another's bytes, with zeros at the end, and a resume trains on that. Loading is right. NVIDIA/Megatron-LM#5077
subtracts the removed padding on main; no megatron-core release we can install has it (0.19.2 has not).

``unpadded_offsets`` lends each buffer, for the save's ``sharded_state_dict`` only, a ``param_index_map`` with the
offsets of the gathered tensors: the same keys in the same order (the load iterates it), each (start, end) moved
back by the padding removed before its bucket. No megatron class is copied or patched; with one bucket the map
lent is the same. Drop this module with a megatron-core that has #5077 (check: its
``sharded_param_state_fully_reshardable`` subtracts the stripped padding).
"""

from __future__ import annotations

import contextlib


def _buffers(optimizer):
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        yield from getattr(part, "buffers", ())


def unpadded_index_map(buffer) -> dict:
    """``buffer.param_index_map`` with each (start, end) in the buffer without its bucket-end padding."""
    starts, unpadded = [], 0
    for bucket in buffer.buckets:
        starts.append(bucket.offset - unpadded)  # padding removed before this bucket
        unpadded += bucket.numel_unpadded
    return {param: (start - starts[b], end - starts[b], b) for param, (start, end, b) in buffer.param_index_map.items()}


@contextlib.contextmanager
def unpadded_offsets(optimizer):
    """Around the save's ``optimizer.sharded_state_dict``: the offsets its slices of the gathered state need."""
    lent = [(buffer, buffer.param_index_map) for buffer in _buffers(optimizer)]
    try:
        for buffer, _ in lent:
            buffer.param_index_map = unpadded_index_map(buffer)
        yield
    finally:
        for buffer, original in lent:
            buffer.param_index_map = original
