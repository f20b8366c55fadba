"""A micro-batch's activations at their peak on one rank: what megatron-core's modules and the STEM layer keep for
backward at this repo's layer spec (no recomputation), and the largest transient on top of them. Checked against a
real forward and backward on CPU (``benchmarks/memory_plan.py --activations``, tests/test_memory_plan.py, which
also runs on a GPU with torch's memory stats; docs/memory.md).

Kept per token and layer, w the compute dtype's bytes (bf16 on GPU, fp32 on CPU):
- each of the two RMSNorms with the linear after it: on CPU torch's composed RMSNorm keeps its input, the input
  normalised and the rsqrt, the linear its output (3 x hidden + 1, fp32); on GPU TE's fused norm and linear, or
  torch's fused CUDA RMSNorm, keep the input and the rsqrt (fp32), the linear the output: 2 x hidden;
- attention: ``attention_kept``;
- the FFN, in d_ff/tp: dense 5 on CPU (SiLU's input, the whole fc1 output; SiLU's output; the up half plus its 0
  offset; fc2's input), 3 on GPU (megatron's fused SwiGLU keeps fc1's output, fc2 its input); STEM with host tables
  2 (``stem_rows``: the gate's output and W_d's input) and, on GPU, its micro-batch's compact rows in bf16 once a
  layer (on CPU they are the fp32 rows the plan's step rows hold); STEM with device tables, STEM-dagger and the gate
  ablation 4 (the gate, SiLU, the rows or their sum, the product); Hash-MoE 5 (unmeasured).
The last stage adds the final norm and the fp32 logits, V/tp (the softmax the loss keeps, written in place). Not
counted: int64 ids, targets and masks (<= 33 bytes a token) and RoPE's cos and sin (4 x head_dim a position and
layer: 0.2% at 1B).

Transient, once: on the last stage, on GPU the compute-dtype logits beside their fp32 copy (forward's loss) and
then their gradient beside the fp32 one (backward's start), T x V/tp x w; on CPU the output layer's weight and input
gradients, (V/tp + T) x d x 4 (the logits' gradient is written into the kept softmax). On other stages a dense
FFN's backward, T x 3 d_ff/tp x w (unmeasured). On CPU the plan predicts a process's memory, whose RSS is above
torch's allocations: ``CPU_HEAP``.
"""

from __future__ import annotations

from stem_megatron.config import RunConfig
from stem_megatron.flops.layout import Layout, stage_layers
from stem_megatron.layer_plan import planned_layers
from stem_megatron.run_plan import tables_on_host

FP32 = 4
# the rise of a CPU process's RSS over its first micro-batches against torch's allocations at their peak (glibc's
# heap, the libraries' buffers made at first use): 1.18 at the 350M recipe's widths, 1.51 on the demo's tiny model,
# fresh processes (docs/memory.md); 1 on GPU, whose caching allocator's reserve over its allocations is unmeasured
CPU_HEAP = 1.4


def attention_kept(cfg: RunConfig, layout: Layout) -> tuple[str, float]:
    """(the attention kernel every layer of the run takes, and why; the bytes it and its module keep for backward
    per token and layer on one rank).

    All paths keep q and k after RoPE and v: with K/V grouped (or MHA) v is a view of the fused QKV output, which
    stays whole (d + 2kv, then d + kv for q and k); repeated to every head (``SDPAttention`` outside the CUDA flash
    kernel, ``_kernel_takes_grouped_kv``; TE's unfused attention) they are 3 new tensors of d and the QKV output is
    freed. Then the output: the context ``linear_proj`` keeps is the kernel's own output where the kernel writes it
    sequence-first (TE; SDPA's CPU flash kernel allocates it like q, measured, and so, assumed, does CUDA flash: the
    module's reshape is then a view), a copy besides it where it is batch-first (the CUDA memory-efficient). Then
    either a logsumexp per query and head (fp32) or the s x s probabilities of every head. Attention dropout is
    fixed at 0 (``model/gpt.py``): with it SDPA would take its math kernel, which keeps the probabilities.
    """
    m, tp, gpu = cfg.model, layout.tp, layout.device == "gpu"
    d, heads, seq = m.hidden_size, m.num_attention_heads, m.seq_length
    kv = (m.num_query_groups or heads) * (d // heads)
    w = 2 if gpu else FP32
    mask = cfg.data.reset_attention_mask  # the batches' per-document bool mask [b, 1, s, s]; else causal, no mask
    mask_bytes = 0  # per element of an additive [b, 1, s, s] mask the kernel makes from the bool one, per layer
    if gpu and layout.transformer_engine and mask:
        path = "TE's unfused attention: TE runs an arbitrary mask in neither flash nor cuDNN; keeps s x s (bf16)"
        grouped, output_copy, probabilities = False, False, True
    elif gpu and layout.transformer_engine:
        path = "TE's fused attention (flash / cuDNN, causal)"
        grouped, output_copy, probabilities = True, False, False
    elif gpu and mask:
        # assumed from torch's documented dispatch: flash takes no mask tensor, so the memory-efficient kernel (or
        # cuDNN where torch ranks it first) runs; SDPA turns the bool mask into an additive one in q's dtype and the
        # kernel keeps it for backward: [b, 1, s, s] bf16 per layer (broadcast over heads), no s x s per head
        path = "SDPA's memory-efficient kernel: CUDA flash takes no mask; keeps the bf16 additive mask per layer"
        grouped, output_copy, probabilities, mask_bytes = False, True, False, w
    elif gpu:
        path = "SDPA's CUDA flash kernel (bf16, is_causal, grouped K/V)"
        grouped, output_copy, probabilities = True, False, False
    else:
        # torch 2.13 takes its CPU flash kernel for fp32 without dropout, a mask or not (measured: a bool mask runs
        # _scaled_dot_product_flash_attention_for_cpu too, which keeps the mask made additive, fp32, per layer)
        path = "SDPA's CPU flash kernel" + (" with the per-document mask (keeps it in fp32 per layer)" if mask else "")
        grouped, output_copy, probabilities, mask_bytes = False, False, False, FP32 * mask
    qkv = 2 * d + 3 * kv if grouped or kv == d else 3 * d
    per_head = seq * w if probabilities else FP32  # probabilities or a logsumexp, per query and head
    return path, (qkv + d * (1 + output_copy)) / tp * w + heads / tp * per_head + mask_bytes * seq


def _ffn_terms(variant: str, gpu: bool, compact: bool) -> int:
    """Tensors of d_ff/tp a token's FFN keeps (module docstring)."""
    if variant == "dense":
        return 3 if gpu else 5
    if variant == "hash_moe":
        return 5
    return 2 if compact else 4


def kept_bytes(cfg: RunConfig, layout: Layout, stage: int, distinct_ids: int = 0) -> int:
    """Bytes autograd keeps for the backward of one micro-batch of ``stage``; ``distinct_ids``: the micro-batch's,
    whose compact rows each host STEM layer keeps in bf16 on GPU."""
    m, s, tp, gpu = cfg.model, cfg.stem, layout.tp, layout.device == "gpu"
    w, f = (2 if gpu else FP32), m.ffn_hidden_size / tp
    hidden = m.hidden_size // tp if cfg.parallel.sequence_parallel else m.hidden_size
    norm = 2 * hidden * w + FP32 if gpu else (3 * hidden + 1) * FP32  # a norm and the linear after it
    attention = attention_kept(cfg, layout)[1]
    replaced = set(planned_layers(m.num_layers, s))
    compact = s.variant == "stem" and tables_on_host(cfg)  # ``stem_rows``' product over compact rows
    per_token, compact_layers = 0.0, 0
    for i in stage_layers(cfg, layout.pp, stage):
        per_token += 2 * norm + attention + _ffn_terms(s.variant if i in replaced else "dense", gpu, compact) * f * w
        compact_layers += gpu and compact and i in replaced
    per_token += m.seq_length * cfg.data.reset_attention_mask  # the batch's bool mask [b, 1, s, s], held once
    if stage == layout.pp - 1:
        per_token += norm + m.vocab_size / tp * FP32  # the final norm, the fp32 logits
    return int(per_token * cfg.train.micro_batch_size * m.seq_length + compact_layers * distinct_ids * f * w)


def transient_bytes(cfg: RunConfig, layout: Layout, stage: int) -> int:
    """The most bytes a micro-batch's forward or backward of ``stage`` holds at once beside the kept ones (module
    docstring)."""
    m, tp = cfg.model, layout.tp
    w, tokens = (2 if layout.device == "gpu" else FP32), cfg.train.micro_batch_size * m.seq_length
    if stage < layout.pp - 1:
        return int(tokens * 3 * m.ffn_hidden_size / tp * w)
    vocab = m.vocab_size / tp
    return int(tokens * vocab * w if w < FP32 else (vocab + tokens) * m.hidden_size * FP32)


def activation_bytes(cfg: RunConfig, layout: Layout, stage: int, in_flight: int, distinct_ids: int = 0) -> int:
    """The activations of ``in_flight`` micro-batches of ``stage`` at their peak (1F1B holds that many between
    forward and backward): what each keeps, one transient, and on CPU the process's heap over them."""
    peak = in_flight * kept_bytes(cfg, layout, stage, distinct_ids) + transient_bytes(cfg, layout, stage)
    return int(peak * (CPU_HEAP if layout.device == "cpu" else 1))
