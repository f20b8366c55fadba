"""Single-process use of a trained model: the export format and an inference model over it."""
