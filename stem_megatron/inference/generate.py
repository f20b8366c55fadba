"""Batch generation with a KV cache, STEM rows from host memory, and the per-step parameter-byte report.

``generate_batch(model, prompts, max_new_tokens)`` decodes a batch of prompts on an ``InferenceModel``
(``inference.model``; ``stem-generate`` loads it with ``placement="host"``):

* **KV cache**: megatron-core's own ``StaticInferenceContext`` passed as ``inference_context=`` to
  ``GPTModel.forward`` (local, non-TE modules; works on the CPU through ``cpu_compat``). Attention
  stores each layer's keys/values in the context's buffers, RoPE is sliced at the context's
  ``sequence_len_offset``, and only the last position's logits are materialised.
* **Batches of prompts of different lengths** follow megatron's static-batching scheme (its
  ``TextGenerationController``): the prefill runs the first ``min(len)`` tokens of every prompt; each
  later step feeds one position for every row, taking the row's own prompt token while its prompt
  lasts and its sampled token afterwards. Every row sees exactly its own causal prefix, so no
  padding or attention mask is needed, and each row's tokens equal those of decoding it alone. Rows
  that finish (``max_new_tokens``, EOD, a stop string) leave the batch: their columns are dropped from
  the context's key/value buffers.
* **Sampling**: ``sampling.next_token`` (greedy, or temperature + top-p from a seeded
  ``torch.Generator``), row by row in batch order, only for rows that are generating.
* **STEM rows** (``placement="host"``): the tables stay in host memory (``ReadOnlyHostTables``);
  every forward (``InferenceModel.forward``) fetches the rows of its distinct token ids only,
  ``B_uniq x d_ff`` per STEM layer, and the record counts them. ``placement="device"`` keeps them as
  the export's ``U_l`` parameters (the reference).
* **Byte report** (paper Table 1, decoding rows): per forward, the parameter bytes it loads against a
  dense model of the same shape (``flops.decode_bytes.ByteBudget``, ``InferenceModel.budget``).

The KV cache does not slide: ``len(prompt) + max_new_tokens - 1`` must fit in ``model.seq_length``
(``InferenceModel.generate`` recomputes a sliding window instead; within that bound both produce
the same tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from megatron.core.inference.contexts import StaticInferenceContext

from stem_megatron.flops.decode_bytes import ByteBudget
from stem_megatron.inference.model import InferenceModel
from stem_megatron.inference.sampling import next_token


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new ids per prompt (EOD not included)
    steps: list[dict]  # one record per forward: step 0 is the prefill, then one per decode step
    summary: dict = field(default_factory=dict)


def generate_batch(model: InferenceModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   temperature: float = 0.0, top_p: float = 1.0, generator: Optional[torch.Generator] = None,
                   stop: Sequence[str] = ()) -> GenerationResult:
    """New ids for each prompt (a batch decoded together with a KV cache), and the per-forward records.

    Per prompt the same stopping rules as ``InferenceModel.generate``: ``max_new_tokens``, the EOD
    token (not returned), or a ``stop`` string in the decoded output (its tokens are returned).
    """
    prompts = [list(p) for p in prompts]
    if not prompts:
        raise ValueError("no prompts")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: start from a prefix token (e.g. the EOD id)")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if stop:
        model.require_tokenizer()
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens - 1 > model.seq_length:
        raise ValueError(f"a prompt of {longest} tokens + {max_new_tokens} new tokens exceeds model.seq_length="
                         f"{model.seq_length} (the KV cache does not slide): shorten the prompt to at most "
                         f"{model.seq_length + 1 - max_new_tokens} tokens or ask for fewer tokens")
    for p in prompts:
        if min(p) < 0 or max(p) >= model.vocab_size:
            raise ValueError(f"prompt ids must be in [0, {model.vocab_size}), got {min(p)}..{max(p)}")
    if model.host_tables is not None:
        model.host_tables.fetch_count = 0  # forward numbers (cache refreshes) count from this run's prefill
    new: list[list[int]] = [[] for _ in prompts]
    steps: list[dict] = []
    if max_new_tokens == 0:
        return GenerationResult(new, steps, _summary(model, steps, len(prompts)))
    lengths = [len(p) for p in prompts]
    context = StaticInferenceContext(len(prompts), longest + max_new_tokens - 1)
    active = list(range(len(prompts)))  # prompt index of each batch row (= KV buffer column)
    pos = min(lengths)
    logits = _forward(model, torch.tensor([p[:pos] for p in prompts]), context, steps, "prefill")
    while True:
        inputs, finished = [], []
        for row, i in enumerate(active):
            if pos < lengths[i]:  # still inside its prompt: the prompt's token, not a sample
                inputs.append(prompts[i][pos])
                continue
            token = next_token(logits[row, :model.decodable_ids], temperature, top_p, generator)
            inputs.append(token)
            if token == model.eod_id:
                finished.append(row)
                continue
            new[i].append(token)
            if len(new[i]) >= max_new_tokens or (stop and any(s in model.decode(new[i]) for s in stop)):
                finished.append(row)
        if len(finished) == len(active):
            break
        if finished:
            keep = [row for row in range(len(active)) if row not in finished]
            _keep_batch_rows(context, torch.tensor(keep, device=model.device))
            active, inputs = [active[r] for r in keep], [inputs[r] for r in keep]
        logits = _forward(model, torch.tensor(inputs)[:, None], context, steps, "decode")
        pos += 1
    return GenerationResult(new, steps, _summary(model, steps, len(prompts)))


def generate_texts(model: InferenceModel, prompts: Sequence[str], max_new_tokens: int,
                   **kwargs) -> tuple[list[str], GenerationResult]:
    """``generate_batch`` text in, text out (``kwargs`` as for it); a stop string cuts the text it ends."""
    result = generate_batch(model, [model.encode(p) for p in prompts], max_new_tokens, **kwargs)
    return [cut_at_stop(model.decode(ids), kwargs.get("stop", ())) for ids in result.tokens], result


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to the first occurrence of each stop string in turn (generation returns the stop's tokens)."""
    for s in stop:
        text = text.split(s)[0]
    return text


def _forward(model: InferenceModel, tokens: torch.Tensor, context: StaticInferenceContext, steps: list,
             phase: str) -> torch.Tensor:
    """One forward of ``tokens`` [b, s] (CPU) at the context's offset -> last-position logits [b, V]."""
    start = time.perf_counter()
    b, s = tokens.shape
    offset = context.sequence_len_offset
    logits, prefetched = model.forward(tokens, offset, inference_context=context, runtime_gather_output=True)
    context.increment_sequence_len_offset(s)
    logits = logits[:, -1, :].float()
    record = {"step": len(steps), "phase": phase, "batch": b, "tokens": b * s, "position": offset}
    if prefetched is not None:
        stats = prefetched.fetched.stats
        record.update(rows_from_host=stats["rows_from_host"], rows_from_cache=stats["rows_from_cache"],
                      bytes_to_device=stats["bytes_to_device"])
        unique = stats["unique_tokens"]
    else:
        unique = int(torch.unique(tokens).numel())
    record.update(model.budget.step(unique))
    record["step_time_s"] = time.perf_counter() - start
    steps.append(record)
    return logits


def _summary(model: InferenceModel, steps: list[dict], prompts: int) -> dict:
    decode = [r for r in steps if r["phase"] == "decode"]
    host = model.host_tables
    placement = ("host" if host is not None else "device") if model.budget.stem_layers else "no STEM tables"
    summary = {"placement": placement, "prompts": prompts,
               "forwards": len(steps), "decode_steps": len(decode),
               "stem_layers": len(model.budget.stem_layers), "table_bytes": model.budget.table_bytes,
               "cache_rows": model.cache_rows}
    if decode:
        stem = sum(r["stem_bytes"] for r in decode)
        dense = sum(r["dense_model_bytes"] for r in decode)
        summary.update(mean_unique_tokens=sum(r["unique_tokens"] for r in decode) / len(decode),
                       mean_stem_bytes=stem / len(decode), mean_dense_model_bytes=dense / len(decode),
                       stem_over_dense=stem / dense,
                       decode_s=sum(r["step_time_s"] for r in decode))
        if host is not None:
            lookups = sum(r["rows_from_host"] + r["rows_from_cache"] for r in decode)
            summary.update(bytes_to_device=sum(r["bytes_to_device"] for r in decode),
                           cache_hit_rate=sum(r["rows_from_cache"] for r in decode) / lookups if lookups else None)
    return summary


def _keep_batch_rows(context: StaticInferenceContext, keep: torch.Tensor) -> None:
    """Drop finished rows from the key/value buffers (``[seq, batch, ...]``; what megatron's
    ``swap_key_value_dict`` reorders, here also shrunk)."""
    for layer, (key, value) in context.key_value_memory_dict.items():
        context.key_value_memory_dict[layer] = (key.index_select(1, keep), value.index_select(1, keep))


def format_report(result: GenerationResult, budget: ByteBudget) -> str:
    """The per-step byte table (paper Table 1, decoding rows) and a summary, as text."""
    mb = 1 / 2**20
    lines = [f"{'step':>4} {'phase':>7} {'batch':>5} {'B_uniq':>6} {'rows host':>9} {'rows cache':>10} "
             f"{'STEM MiB':>10} {'dense MiB':>10} {'STEM/dense':>10}"]
    for r in result.steps:
        lines.append(f"{r['step']:>4} {r['phase']:>7} {r['batch']:>5} {r['unique_tokens']:>6} "
                     f"{r.get('rows_from_host', '-'):>9} {r.get('rows_from_cache', '-'):>10} "
                     f"{r['stem_bytes'] * mb:>10.4f} {r['dense_model_bytes'] * mb:>10.4f} "
                     f"{r['stem_over_dense']:>10.4f}")
    s = result.summary
    if s.get("decode_steps"):
        lines.append(f"decode steps: {s['decode_steps']}, mean B_uniq {s['mean_unique_tokens']:.2f}, mean bytes per "
                     f"step STEM {s['mean_stem_bytes']:.0f} vs dense {s['mean_dense_model_bytes']:.0f} "
                     f"({s['stem_over_dense']:.4f}x)")
    if budget.stem_layers:
        d, f, e = budget.hidden_size, budget.ffn_hidden_size, budget.element_size
        lines.append(f"per replaced FFN layer (Table 1): dense 3 d d_ff = {budget.dense_ffn_layer_bytes} B; "
                     f"STEM weights {budget.stem_layer_weight_bytes} B + B_uniq x d_ff x {e} B rows "
                     f"(d={d}, d_ff={f}, {len(budget.stem_layers)} STEM layers)")
    return "\n".join(lines)
