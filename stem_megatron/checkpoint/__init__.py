"""Checkpoints: atomic step directories holding dense (dist-checkpointing) and host-table state."""
