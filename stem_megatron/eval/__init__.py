"""Evaluation of an export: lm-eval-harness tasks, Needle-in-a-Haystack, held-out perplexity (``stem-eval``),
and recall / knowledge-edit scores on the synthetic facts (``facts``)."""
