"""A stem-megatron model in Hugging Face ``transformers`` (shipped in every HF export; configuration_stem.py says
what the model is).

The numbers are those of stem-megatron's megatron-core model: RMSNorm as ``x * rsqrt(mean(x^2) + eps) * w``, rotary
positions on the two halves of each head (megatron's non-interleaved layout), softmax scale 1/sqrt(head_dim),
query heads sharing key/value heads in contiguous groups. A STEM layer gathers its rows ``U_l[t]`` for the tokens
at hand from wherever the table lives (with ``stem_tables_on_host``, host memory: ``.to("cuda")`` leaves the
tables there) and moves only those rows to the layer's device.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_stem import StemConfig


class StemRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class StemRotary(nn.Module):
    """cos/sin of ``position_ids`` (fp32), as megatron's RotaryEmbedding computes them. The frequencies are computed
    per call, not kept in a buffer: a non-persistent buffer is not in the checkpoint, and transformers' loading
    leaves it uninitialised."""

    def __init__(self, config: StemConfig):
        super().__init__()
        self.dim, self.theta, self.factor = config.head_dim, config.rope_theta, config.rope_scaling_factor

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Llama 3's scaling (low/high frequency factors 1 and 4 over 8192 original positions), as megatron's."""
        wavelen = 2 * torch.pi / inv_freq
        scaled = torch.where(wavelen > 8192, inv_freq / self.factor, inv_freq)
        smooth = (8192 / wavelen - 1) / (4 - 1)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < 8192 / 4) * ~(wavelen > 8192)
        return torch.where(medium, smoothed, scaled)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32, device=position_ids.device) / self.dim
        inv_freq = 1.0 / (self.theta ** exponents)
        if self.factor is not None:
            inv_freq = self._llama3(inv_freq)
        freqs = position_ids.float()[..., None] * inv_freq  # [b, s, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [b, 1, s, dim]
        return emb.cos(), emb.sin()


class StemAttention(nn.Module):
    def __init__(self, config: StemConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                    config.head_dim)
        d = config.hidden_size
        bias = config.attention_bias
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)

    def forward(self, x, rotary, mask, cache: Optional[Cache]):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class StemSwiGLU(nn.Module):
    """The dense layers' FFN: ``down(SiLU(gate x) * up x)``."""

    def __init__(self, config: StemConfig):
        super().__init__()
        d, d_ff = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, d_ff, bias=False)
        self.up_proj = nn.Linear(d, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d, bias=False)

    def forward(self, x, input_ids):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class StemMLP(nn.Module):
    """The STEM FFN: the up- (or gate-) projection replaced by the row ``U_l[t]`` of each token."""

    def __init__(self, config: StemConfig):
        super().__init__()
        d, d_ff = config.hidden_size, config.intermediate_size
        self.variant = config.stem_variant
        if self.variant in ("stem", "stem_dagger"):
            self.W_g = nn.Linear(d, d_ff, bias=False)
        if self.variant in ("stem_dagger", "stem_gate"):
            self.W_u = nn.Linear(d, d_ff, bias=False)
        self.U_l = nn.Embedding(config.vocab_size, d_ff)
        self.W_d = nn.Linear(d_ff, d, bias=False)

    def rows(self, input_ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``U_l[t]`` for the tokens at hand, gathered where the table is, on the layer's device."""
        table = self.U_l.weight
        return F.embedding(input_ids.to(table.device), table).to(like.device, like.dtype, non_blocking=True)

    def forward(self, x, input_ids):
        if input_ids is None:
            raise ValueError("a STEM layer looks its rows up by token id: call the model with input_ids, "
                             "not inputs_embeds")
        rows = self.rows(input_ids, x)
        if self.variant == "stem":
            h = F.silu(self.W_g(x)) * rows
        elif self.variant == "stem_dagger":
            h = F.silu(self.W_g(x)) * (self.W_u(x) + rows)
        else:
            h = F.silu(rows) * self.W_u(x)
        return self.W_d(h)


class StemDecoderLayer(nn.Module):
    def __init__(self, config: StemConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = StemRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = StemAttention(config, layer_idx)
        self.post_attention_layernorm = StemRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = StemMLP(config) if layer_idx in config.stem_layers else StemSwiGLU(config)

    def forward(self, x, input_ids, rotary, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), rotary, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x), input_ids)


class StemPreTrainedModel(PreTrainedModel):
    config_class = StemConfig
    base_model_prefix = "model"
    _no_split_modules = ["StemDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, std)
        elif isinstance(module, StemRMSNorm):
            module.weight.data.fill_(1.0)

    def _apply(self, fn, recurse=True):
        """With ``stem_tables_on_host`` a move to another device leaves the tables where they are, never copying them
        there (a dtype change still reaches them): they are taken out of the module tree while the rest moves."""
        if not self.config.stem_tables_on_host:
            return super()._apply(fn, recurse)
        owners = [m for m in self.modules() if isinstance(m, StemMLP) and "U_l" in m._modules]
        tables = [owner._modules.pop("U_l") for owner in owners]
        try:
            super()._apply(fn, recurse)
        finally:
            for owner, table in zip(owners, tables):
                owner._modules["U_l"] = table
        for table in tables:
            weight = table.weight
            probe = fn(torch.empty(0, device=weight.device, dtype=weight.dtype))
            if probe.device == weight.device:
                table._apply(fn)
            elif probe.dtype != weight.dtype:
                table.to(dtype=probe.dtype)
        return self


def _mask(attention_mask: Optional[torch.Tensor], batch: int, queries: int, past: int,
          device: torch.device) -> torch.Tensor:
    """[b, 1, q, k] booleans: causal over the cache and the new tokens, padding keys hidden, every query sees
    itself (a padding query's row would otherwise be empty)."""
    keys = past + queries
    q_pos = torch.arange(past, keys, device=device)[:, None]
    k_pos = torch.arange(keys, device=device)[None, :]
    allowed = (k_pos <= q_pos)[None].expand(batch, queries, keys)
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, -keys:].to(device=device, dtype=torch.bool)
    return (allowed | (k_pos == q_pos)[None])[:, None]


class StemModel(StemPreTrainedModel):
    def __init__(self, config: StemConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([StemDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = StemRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = StemRotary(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, **kwargs):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        cache = kwargs.pop("past_key_values", cache)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = (torch.arange(x.shape[1], device=x.device) + past)[None].expand(x.shape[0], -1)
        rotary = self.rotary(position_ids)
        mask = _mask(attention_mask, x.shape[0], x.shape[1], past, x.device)
        for layer in self.layers:
            x = layer(x, input_ids, rotary, mask, cache)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(x), cache=cache if use_cache else None)


class StemForCausalLM(StemPreTrainedModel, GenerationMixin):
    def __init__(self, config: StemConfig):
        super().__init__(config)
        self.model = StemModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=kwargs.pop("past_key_values", cache), inputs_embeds=inputs_embeds, use_cache=use_cache)
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache)
