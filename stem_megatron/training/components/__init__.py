"""What the training loop calls around a step, one noun a module; each decides when it acts.

- ``probes``: the profiler and the two step audits, around the step each is set to.
- ``step_meter``: the step's record from what it measured (time, tokens, the tables' and Hash-MoE's counters).
- ``loss_spikes``, ``validator``: their fields in the step record; a line for a spike.
- ``skipped_steps``: the steps not applied (``train.skip_steps``, or not finite), and the stop after too many in a row.
- ``step_log``: ``metrics.jsonl``, the console's step line and W&B, for the steps kept.
- ``checkpointer``: the checkpoint resumed from, saves by step, time or signal, a stop's ``stopped.json``.
- ``exporter``: the export after the run's last step.

``training/preemption.py``'s ``StopSignals`` tells every rank, at one place of each step, of a signal or a save due.
"""
