"""The Hugging Face export (``stem-export-hf``) and the transformers model it ships."""
