"""A run's start from a Hugging Face Llama or Qwen2 model (``checkpoint.init_from_hf``; docs/checkpoints.md)."""
