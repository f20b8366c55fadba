"""Data pipeline: preprocessing to megatron indexed datasets, integrity checks, megatron GPT datasets
(packing, blending, cross-document masks) and deterministic data-parallel micro-batches."""
