"""stem-megatron: pretraining STEM transformers (token-indexed FFN up-projection) on megatron-core."""

from stem_megatron import quiet

__version__ = "0.1.0"

quiet.install()  # before any module of ours imports megatron: its known-harmless notices (quiet.py)
