"""What the training loop calls around a step, one noun a module; each decides when it acts.

- ``probes``: the profiler and the two step audits, around the step each is set to.
- ``loss_spikes``: its fields in the step record, and a line for a spike.
"""
