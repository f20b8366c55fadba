"""The configuration of a stem-megatron model in Hugging Face ``transformers`` (shipped in every HF export).

A Llama-style decoder (RMSNorm, rotary positions, SwiGLU, no biases but q/k/v ones with ``attention_bias`` (an
imported Qwen2), untied embeddings; ``rope_scaling_factor``: Llama 3's RoPE scaling) whose layers in
``stem_layers`` have a STEM FFN (paper eq. 4, 5; Table 3) instead of the SwiGLU one:

    stem        y = W_d (SiLU(W_g x) * U_l[t])
    stem_dagger y = W_d (SiLU(W_g x) * (W_u x + U_l[t]))
    stem_gate   y = W_d (SiLU(U_l[t]) * W_u x)

``stem_tables_on_host``: the tables ``U_l`` stay in host memory when the model moves to a GPU, and each forward
copies the rows of its tokens only (the paper's inference claim).
"""

from transformers import PretrainedConfig

STEM_VARIANTS = ("stem", "stem_dagger", "stem_gate")


class StemConfig(PretrainedConfig):
    model_type = "stem_megatron"
    keys_to_ignore_at_inference = ["cache"]

    def __init__(self, vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=None, rms_norm_eps=1e-5, rope_theta=10000.0,
                 max_position_embeddings=2048, attention_bias=False, rope_scaling_factor=None, stem_variant="stem",
                 stem_layers=(), stem_tables_on_host=False, initializer_range=0.02, use_cache=True, bos_token_id=0,
                 eos_token_id=0, pad_token_id=0, tie_word_embeddings=False, **kwargs):
        if stem_variant not in STEM_VARIANTS:
            raise ValueError(f"stem_variant {stem_variant!r} is not one of {STEM_VARIANTS}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = hidden_size // num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.attention_bias = attention_bias
        self.rope_scaling_factor = rope_scaling_factor
        self.stem_variant = stem_variant
        self.stem_layers = list(stem_layers)
        self.stem_tables_on_host = stem_tables_on_host
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
