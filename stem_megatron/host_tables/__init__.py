"""``U_l`` in host memory: one row state, one row optimizer, two tiers behind one face, one step pipeline.

The map (docs/host_tables.md has the concepts and a step of each tier as a timeline):
- ``placement``: the tables or their absence (``build_tables``, ``NoTables``), asked once.
- ``store``: the public face (``HostTableStore`` from one ``StoreConfig``, ``HostRowSource``); the tier and its
  pipeline chosen there, once.
- ``row_state``: a row's master and moments in one layout, in the dtypes of ``table_state.StateSpec`` (``RowState``);
  the node's host record (``HostRecord``).
- ``row_optimizer``: AdamW on rows, lazy or dense, DeepSpeed's CPU kernel or torch's fused one, or the lean update
  (``lean_adam``, ``csrc/lean_adam.cpp``); ``adam_thread``: when it runs (``RowUpdates``, ``LaterDecay``).
- ``tier``, ``host_tier``, ``device_tier`` (with ``working_set``, ``staged_rows``, ``hot_rows``): where a step's rows
  are read and updated.
- ``pipeline``: the prefetch thread and a step's order; ``row_gradients``: the row gradients out of backward.
- ``exchange``, ``ownership``: rows' owners across nodes and the traffic to and from them.
- ``transfer``: pinned buffers and side streams between host and device; ``node``: shared files, host memory, threads.
"""
