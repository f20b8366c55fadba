"""Tiny random Hugging Face models made with transformers' own config classes (no download), and the run configs
that import them. A plain module, not a fixture: spawned workers (``distributed.run``) import it by name.

- llama: untied embeddings, GQA (4 heads, 2 groups), rope theta 50,000 with Llama 3's scaling (factor 8), eps 1e-6;
- qwen2: q/k/v biases, tied embeddings, rope theta 1,000,000, and a vocabulary of 401 (one id past the tokenizer's),
  so TP=2 pads it to 402.
"""

import shutil
from pathlib import Path

import torch
from conftest import VOCAB

from stem_megatron.config import CheckpointConfig, DataConfig, ModelConfig, ParallelConfig, RunConfig, STEMConfig

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             rms_norm_eps=1e-6)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
ARCHS = {"llama": dict(vocab_size=VOCAB, rope_parameters=LLAMA3_ROPE, max_position_embeddings=16384,
                       tie_word_embeddings=False),
         "qwen2": dict(vocab_size=VOCAB + 1, rope_theta=1000000.0, max_position_embeddings=64,
                       tie_word_embeddings=True)}
THETA = {"llama": 50000, "qwen2": 1000000}


def save_hf_model(arch: str, corpus: Path, out: Path) -> Path:
    """``out``: a random ``arch`` model (its weights perturbed so no bias or norm is trivial) saved by transformers,
    with the corpus' tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config, model = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    torch.manual_seed(0)
    hf = model(config(**SHAPE, **ARCHS[arch]))
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    hf.save_pretrained(out)
    shutil.copy(corpus / "tokenizer.json", out / "tokenizer.json")
    return out


def import_config(arch: str, corpus: Path, hf_dir: Path, tp: int = 1, pp: int = 1, **stem) -> RunConfig:
    """A run of ``hf_dir`` (the model fields of ``arch``, the vocabulary padded to TP's multiple)."""
    vocab = ARCHS[arch]["vocab_size"]
    return RunConfig(
        model=ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                          vocab_size=-(-vocab // tp) * tp, seq_length=32, rotary_base=THETA[arch], norm_epsilon=1e-6,
                          qkv_bias=arch == "qwen2", rope_scaling_factor=8.0 if arch == "llama" else None),
        stem=STEMConfig(**({"variant": "dense"} | stem)),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
        data=DataConfig(dir=str(corpus), vocab_size=VOCAB),
        checkpoint=CheckpointConfig(init_from_hf=str(hf_dir), save=False), out_dir=str(hf_dir.parent / f"run-{arch}"))
