"""Training: optimizer/schedule, the per-step schedule call, metrics, the run loop and its components."""
