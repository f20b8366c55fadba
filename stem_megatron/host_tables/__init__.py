"""``U_l`` in host memory: one row state, one row optimizer, two tiers behind one face, one step pipeline.

The map (docs/host_tables.md has the concepts and a step of each tier as a timeline):
- ``store``: the public face (``HostTableStore``, ``build_store``, ``HostRowSource``); the tier chosen there, once.
- ``row_state``: a row's fp32 master and moments in one layout (``RowState``); the node's host record (``HostRecord``).
- ``row_optimizer``: AdamW on rows, lazy or dense, DeepSpeed's CPU kernel or torch's fused one; the dense decay's
  schedule (``LaterDecay``).
- ``host_tier``, ``device_tier`` (with ``working_set``): where a step's rows are read and updated.
- ``pipeline``: the prefetch thread, the row gradients out of backward, the Adam thread, a step's order.
- ``exchange``, ``ownership``: rows' owners across nodes and the traffic to and from them.
- ``transfer``: pinned buffers and side streams between host and device; ``node``: shared files, host memory, threads.
"""
