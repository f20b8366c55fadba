"""Batch generation with a KV cache, STEM rows from host memory, and the per-step parameter-byte report.

``GenerationModel(export_dir, placement="host"|"device", cache_rows=K)`` loads an export and decodes
batches of prompts:

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
* **STEM rows** (``placement="host"``): the tables stay in host memory (``host_rows.ReadOnlyHostTables``);
  every forward fetches the rows of its distinct token ids only, ``B_uniq x d_ff`` per STEM layer,
  through ``token_ids(tokens, V, prefetched)`` and the training path's ``HostRowSource``.
  ``placement="device"`` keeps them as the export's ``U_l`` parameters (the reference).
* **Byte report** (paper Table 1, decoding rows): per forward, the parameter bytes it loads against a
  dense model of the same shape (``ByteBudget``).

The KV cache does not slide: ``len(prompt) + max_new_tokens - 1`` must fit in ``model.seq_length``
(``InferenceModel.generate`` recomputes a sliding window instead; within that bound both produce
the same tokens).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

import torch
from megatron.core.inference.contexts import StaticInferenceContext

from stem_megatron.config import RunConfig
from stem_megatron.data.tokenizer import HFTokenizer
from stem_megatron.export.format import ExportError, read_export
from stem_megatron.host_tables.read_only import ReadOnlyHostTables, build_host_rows_model, split_tables
from stem_megatron.inference.sampling import next_token
from stem_megatron.export.single_process import build_single_process_model, parameter_shapes
from stem_megatron.model.sharding import load_full_weights
from stem_megatron.model.token_context import token_ids

PLACEMENTS = ("host", "device")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EMBEDDING = "embedding.word_embeddings.weight"


# ------------------------------------------------------------------------------------- byte report
@dataclass(frozen=True)
class ByteBudget:
    """Parameter bytes one forward loads, for a STEM model and a dense model of the same shape.

    Counted per forward (one decode step of the whole batch):

    * ``weight_bytes``: every parameter except the STEM tables and the input embedding, loaded whole
      (attention, norms, dense FFNs, the STEM layers' ``W_g``/``W_u``/``W_d``, the output layer);
    * input embedding: ``B_uniq`` rows of ``d`` (the same in both models);
    * STEM rows: ``B_uniq`` rows of ``d_ff`` per STEM layer.

    The dense model of the same shape has a SwiGLU FFN (``W_g``, ``W_u``, ``W_d``: ``3 d d_ff``) where
    the STEM model has a STEM layer, so for ``stem`` it loads ``d x d_ff`` more per replaced layer (the
    up-projection) and no rows: Table 1's decoding parameter loading ``3 d d_ff`` vs ``2 d d_ff`` per
    layer, plus the ``B_uniq d_ff`` rows STEM moves instead. For ``stem_dagger`` (which keeps ``W_u``)
    the dense model loads the same weights and no rows. Models without tables (dense, Hash-MoE) count
    every non-embedding parameter as loaded.
    """

    hidden_size: int
    ffn_hidden_size: int
    element_size: int  # bytes per parameter (fp32 exports: 4)
    stem_layers: tuple[int, ...]  # global 0-based indices of the layers with a U_l table
    weight_bytes: int
    stem_layer_weight_bytes: int  # W_g/W_u/W_d of one STEM layer (0 without STEM layers)
    table_bytes: int  # all U_l tables

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, Sequence[int]], element_size: int = 4) -> "ByteBudget":
        """From the single-process model's ``{parameter name: shape}`` (an export's weights)."""
        numel = {name: _numel(shape) for name, shape in shapes.items()}
        if _EMBEDDING not in shapes:
            raise ValueError(f"no {_EMBEDDING} among the parameters: not a single-process GPT model")
        vocab, d = shapes[_EMBEDDING]
        tables = {int(_LAYER.match(n).group(1)): n for n in shapes if n.endswith(".mlp.U_l.weight")}
        d_ff = _numel(shapes[next(iter(tables.values()))]) // vocab if tables else 0
        weights = sum(n for name, n in numel.items() if name != _EMBEDDING and name not in tables.values())
        per_layer = {i: sum(n for name, n in numel.items()
                            if name.startswith(f"decoder.layers.{i}.mlp.") and name != tables[i]) for i in tables}
        if len(set(per_layer.values())) > 1:
            raise ValueError(f"STEM layers of different shapes: {per_layer}")
        return cls(hidden_size=d, ffn_hidden_size=d_ff, element_size=element_size, stem_layers=tuple(sorted(tables)),
                   weight_bytes=weights * element_size,
                   stem_layer_weight_bytes=next(iter(per_layer.values()), 0) * element_size,
                   table_bytes=sum(numel[n] for n in tables.values()) * element_size)

    @property
    def dense_ffn_layer_bytes(self) -> int:
        """A SwiGLU FFN layer of the same shape: ``3 d d_ff`` parameters."""
        return 3 * self.hidden_size * self.ffn_hidden_size * self.element_size

    @property
    def dense_model_weight_bytes(self) -> int:
        """``weight_bytes`` of the dense model of the same shape (every replaced layer a SwiGLU FFN)."""
        n = len(self.stem_layers)
        return self.weight_bytes - n * self.stem_layer_weight_bytes + n * self.dense_ffn_layer_bytes

    def step(self, unique_tokens: int) -> dict:
        """Bytes one forward over ``unique_tokens`` distinct ids loads, STEM vs dense, and per layer."""
        u, e = unique_tokens, self.element_size
        embedding = u * self.hidden_size * e
        rows_per_layer = u * self.ffn_hidden_size * e
        rows = rows_per_layer * len(self.stem_layers)
        stem = self.weight_bytes + embedding + rows
        dense = self.dense_model_weight_bytes + embedding
        return {
            "unique_tokens": u,
            "weight_bytes": self.weight_bytes,
            "embedding_row_bytes": embedding,
            "stem_row_bytes": rows,
            "stem_bytes": stem,
            "dense_model_bytes": dense,
            "saved_bytes": dense - stem,
            "stem_over_dense": stem / dense,
            # Table 1, decoding rows, one replaced FFN layer
            "layer_dense_ffn_bytes": self.dense_ffn_layer_bytes if self.stem_layers else 0,
            "layer_stem_ffn_bytes": self.stem_layer_weight_bytes,
            "layer_stem_row_bytes": rows_per_layer if self.stem_layers else 0,
        }


def decode_byte_budget(cfg: RunConfig, element_size: int = 4) -> ByteBudget:
    """``ByteBudget`` of a config's single-process model, from a meta-device build (no memory)."""
    return ByteBudget.from_shapes(parameter_shapes(cfg), element_size)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# ------------------------------------------------------------------------------------- generation
@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new ids per prompt (EOD not included)
    steps: list[dict]  # one record per forward: step 0 is the prefill, then one per decode step
    summary: dict = field(default_factory=dict)


class GenerationModel:
    """An export loaded for KV-cache generation, STEM tables on the device or in host memory."""

    def __init__(self, export_dir, placement: str = "host", cache_rows: int = 0, device: Optional[str] = None,
                 refresh_every: int = 50):
        if placement not in PLACEMENTS:
            raise ValueError(f"placement {placement!r} is not one of {PLACEMENTS}")
        if cache_rows < 0:
            raise ValueError(f"cache_rows={cache_rows} must be >= 0")
        if cache_rows and placement != "host":
            raise ValueError("cache_rows needs placement='host' (on-device tables need no row cache)")
        self.export_dir = Path(export_dir)
        self.config, weights, tokenizer_path = read_export(export_dir)
        self.seq_length = self.config.model.seq_length
        self.vocab_size = self.config.model.vocab_size
        self.tokenizer = HFTokenizer(tokenizer_path) if tokenizer_path else None
        if self.tokenizer is not None and self.tokenizer.vocab_size > self.vocab_size:
            raise ExportError(f"{tokenizer_path} has {self.tokenizer.vocab_size} ids but model.vocab_size is "
                              f"{self.vocab_size}: the export's tokenizer is not the one the model was trained with")
        self.eod_id = self.tokenizer.eod if self.tokenizer is not None else None
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.placement = placement
        self.budget = ByteBudget.from_shapes({n: w.shape for n, w in weights.items()},
                                             weights[_EMBEDDING].element_size())
        tables, rest = split_tables(weights)
        if placement == "host" and tables:
            self.rows: Optional[ReadOnlyHostTables] = ReadOnlyHostTables(tables, self.device, cache_rows, refresh_every)
            model = build_host_rows_model(self.config, self.rows)
            weights = rest  # the tables live in self.rows only
        else:  # device placement, or a model without STEM tables (dense, Hash-MoE)
            self.rows = None
            model = build_single_process_model(self.config)
        load_full_weights(model, weights)
        self.model = model.to(self.device).eval()

    # ----------------------------------------------------------------------------------- text
    def encode(self, text: str) -> list[int]:
        return self._require_tokenizer().tokenize(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._require_tokenizer().detokenize(list(ids))

    def _require_tokenizer(self) -> HFTokenizer:
        if self.tokenizer is None:
            raise ExportError(f"export {self.export_dir} has no tokenizer.json: pass token ids instead of text")
        return self.tokenizer

    # ------------------------------------------------------------------------------ decoding
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, generator: Optional[torch.Generator] = None,
                 stop: Sequence[str] = ()) -> GenerationResult:
        """New ids for each prompt (a batch decoded together), and the per-forward records.

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
            self._require_tokenizer()
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens - 1 > self.seq_length:
            raise ValueError(f"a prompt of {longest} tokens + {max_new_tokens} new tokens exceeds model.seq_length="
                             f"{self.seq_length} (the KV cache does not slide): shorten the prompt to at most "
                             f"{self.seq_length + 1 - max_new_tokens} tokens or ask for fewer tokens")
        for p in prompts:
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise ValueError(f"prompt ids must be in [0, {self.vocab_size}), got {min(p)}..{max(p)}")
        if self.rows is not None:
            self.rows.fetches.clear()
        new: list[list[int]] = [[] for _ in prompts]
        steps: list[dict] = []
        if max_new_tokens == 0:
            return GenerationResult(new, steps, self._summary(steps, len(prompts)))
        decodable = self.tokenizer.vocab_size if self.tokenizer is not None else self.vocab_size
        lengths = [len(p) for p in prompts]
        context = StaticInferenceContext(len(prompts), longest + max_new_tokens - 1)
        active = list(range(len(prompts)))  # prompt index of each batch row (= KV buffer column)
        pos = min(lengths)
        logits = self._forward(torch.tensor([p[:pos] for p in prompts]), context, steps, "prefill")
        while True:
            inputs, finished = [], []
            for row, i in enumerate(active):
                if pos < lengths[i]:  # still inside its prompt: the prompt's token, not a sample
                    inputs.append(prompts[i][pos])
                    continue
                token = next_token(logits[row, :decodable], temperature, top_p, generator)
                inputs.append(token)
                if token == self.eod_id:
                    finished.append(row)
                    continue
                new[i].append(token)
                if len(new[i]) >= max_new_tokens or (stop and any(s in self.decode(new[i]) for s in stop)):
                    finished.append(row)
            if len(finished) == len(active):
                break
            if finished:
                keep = [row for row in range(len(active)) if row not in finished]
                _keep_batch_rows(context, torch.tensor(keep, device=self.device))
                active, inputs = [active[r] for r in keep], [inputs[r] for r in keep]
            logits = self._forward(torch.tensor(inputs)[:, None], context, steps, "decode")
            pos += 1
        return GenerationResult(new, steps, self._summary(steps, len(prompts)))

    def generate_text(self, prompts: Sequence[str], max_new_tokens: int,
                      **kwargs) -> tuple[list[str], GenerationResult]:
        """Text in, text out (``kwargs`` as for ``generate``); a stop string cuts the text it ends."""
        result = self.generate([self.encode(p) for p in prompts], max_new_tokens, **kwargs)
        texts = [self.decode(ids) for ids in result.tokens]
        for s in kwargs.get("stop", ()):
            texts = [t.split(s)[0] for t in texts]
        return texts, result

    def _forward(self, tokens: torch.Tensor, context: StaticInferenceContext, steps: list, phase: str) -> torch.Tensor:
        """One forward of ``tokens`` [b, s] (CPU) at the context's offset -> last-position logits [b, V]."""
        start = time.perf_counter()
        b, s = tokens.shape
        offset = context.sequence_len_offset
        prefetched = self.rows.fetch(tokens) if self.rows is not None else None
        tokens_d = tokens.to(self.device)
        positions = torch.arange(offset, offset + s, device=self.device).unsqueeze(0).expand(b, s)
        with token_ids(tokens_d, self.vocab_size, prefetched):
            logits = self.model(tokens_d, positions, None, inference_context=context, runtime_gather_output=True)
        context.increment_sequence_len_offset(s)
        logits = logits[:, -1, :].float()
        record = {"step": len(steps), "phase": phase, "batch": b, "tokens": b * s, "position": offset}
        if prefetched is not None:
            stats = prefetched.fetched.stats
            record.update(rows_from_host=stats["rows_from_host"], rows_from_cache=stats["rows_from_cache"],
                          bytes_to_device=stats["bytes_to_device"])
            unique = stats["unique_tokens"]
            self.rows.refresh_cache(len(steps) + 1)
        else:
            unique = int(torch.unique(tokens).numel())
        record.update(self.budget.step(unique))
        record["step_time_s"] = time.perf_counter() - start
        steps.append(record)
        return logits

    def _summary(self, steps: list[dict], prompts: int) -> dict:
        decode = [r for r in steps if r["phase"] == "decode"]
        placement = ("host" if self.rows is not None else "device") if self.budget.stem_layers else "no STEM tables"
        summary = {"placement": placement, "prompts": prompts,
                   "forwards": len(steps), "decode_steps": len(decode),
                   "stem_layers": len(self.budget.stem_layers), "table_bytes": self.budget.table_bytes,
                   "cache_rows": self.rows.cache.capacity if self.rows is not None else 0}
        if decode:
            stem = sum(r["stem_bytes"] for r in decode)
            dense = sum(r["dense_model_bytes"] for r in decode)
            summary.update(mean_unique_tokens=sum(r["unique_tokens"] for r in decode) / len(decode),
                           mean_stem_bytes=stem / len(decode), mean_dense_model_bytes=dense / len(decode),
                           stem_over_dense=stem / dense,
                           decode_s=sum(r["step_time_s"] for r in decode))
            if self.rows is not None:
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
