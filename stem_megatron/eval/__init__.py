"""Evaluation of an export: lm-eval-harness tasks, Needle-in-a-Haystack, held-out perplexity (``stem-eval``)."""
