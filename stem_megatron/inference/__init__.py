"""Single-process use of an export: ``InferenceModel`` (scoring, sliding-window generation, STEM tables on the
device or in host memory) and KV-cache batch decoding with its byte report (``generate``, ``stem-generate``)."""
