"""Model: STEM/dense MLP layer specs for megatron-core's GPTModel."""
