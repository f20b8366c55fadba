"""stem-megatron: pretraining STEM transformers (token-indexed FFN up-projection) on megatron-core."""

__version__ = "0.1.0"
