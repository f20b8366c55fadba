"""``InferenceModel``: an export loaded into one process for scoring, generation and edits.

The STEM tables are either the export's ``U_l`` parameters on the device (``placement="device"``) or
stay in host memory (``placement="host"``, ``inference.host_rows.ReadOnlyHostTables``): every
forward then fetches the rows of its distinct token ids only and hands them to the STEM layers
through ``token_ids``, with an optional device cache of the hottest rows (``cache_rows``).

Scoring follows lm-eval's causal-LM conventions: a context longer than ``model.seq_length`` loses
its oldest tokens, a continuation is scored from the logits that predict it. Batches are padded on
the right, which causal attention keeps invisible to every real position. ``generate`` recomputes
the last ``seq_length`` tokens for every new token; ``generate.generate_batch`` decodes batches of
prompts with a KV cache instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec

from stem_megatron.config import RunConfig
from stem_megatron.data.integrity import check_token_ids
from stem_megatron.data.tokenizer import HFTokenizer
from stem_megatron.export.format import ExportError, read_export
from stem_megatron.export.single_process import (
    build_single_process_model,
    ensure_single_process_state,
    single_process_config,
)
from stem_megatron.flops.decode_bytes import ByteBudget
from stem_megatron.host_tables.store import HostRowSource
from stem_megatron.host_tables.transfer import PrefetchedRows
from stem_megatron.inference.host_rows import ReadOnlyHostTables, split_tables
from stem_megatron.inference.sampling import next_token
from stem_megatron.model.gpt import build_gpt, transformer_config
from stem_megatron.model.sharding import load_full_weights
from stem_megatron.model.token_context import token_ids

PLACEMENTS = ("device", "host")
_PAD = 0  # any valid id: right padding is never attended to by real positions


class InferenceModel:
    """The export's single-process GPT model, its tokenizer (if exported) and scoring/generation on them.

    ``placement``: STEM tables as device parameters or in host memory (``host_tables``; models
    without tables, dense or Hash-MoE, are the same either way). ``cache_rows``: rows per table kept
    on the device with host placement, re-chosen every ``refresh_every`` forwards.
    """

    def __init__(self, export_dir, placement: str = "device", cache_rows: int = 0, device: Optional[str] = None,
                 refresh_every: int = 50):
        if placement not in PLACEMENTS:
            raise ValueError(f"placement {placement!r} is not one of {PLACEMENTS}")
        if cache_rows < 0:
            raise ValueError(f"cache_rows={cache_rows} must be >= 0")
        on_host = placement == "host"
        if cache_rows and not on_host:
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
        self.budget = ByteBudget.from_weights(weights)  # parameter bytes per forward (generate.generate_batch)
        tables, rest = split_tables(weights)
        self.host_tables: Optional[ReadOnlyHostTables] = None
        if on_host and tables:
            self.host_tables = ReadOnlyHostTables(tables, self.device, cache_rows, refresh_every)
            model = build_host_rows_model(self.config, self.host_tables)
            weights = rest  # the tables live in self.host_tables only
        else:  # device placement, or a model without STEM tables (dense, Hash-MoE)
            model = build_single_process_model(self.config)
        load_full_weights(model, weights)
        self.model = model.to(self.device).eval()

    @property
    def cache_rows(self) -> int:
        """Rows per STEM table the hot-row cache keeps on the device (0: no cache)."""
        return self.host_tables.cache.capacity if self.host_tables is not None else 0

    def tables(self) -> dict[int, torch.Tensor]:
        """``{0-based layer index: V x d_ff U_l}``: the live tensors (on the device or in host memory) that
        the forward reads, so an in-place edit changes the model. Empty without STEM layers."""
        if self.host_tables is not None:
            return {layer - 1: t for layer, t in self.host_tables.tables.items()}
        tables, _ = split_tables({n: p.data for n, p in self.model.named_parameters()})
        return {layer - 1: t for layer, t in tables.items()}

    # ----------------------------------------------------------------------------------- text
    def encode(self, text: str) -> list[int]:
        return self.require_tokenizer().tokenize(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.require_tokenizer().detokenize(list(ids))

    def require_tokenizer(self) -> HFTokenizer:
        if self.tokenizer is None:
            raise ExportError(f"export {self.export_dir} has no tokenizer.json: re-export with the data dir's "
                              "tokenizer (write_export(..., tokenizer_path=...)) or pass token ids")
        return self.tokenizer

    @property
    def decodable_ids(self) -> int:
        """Generation samples ids below this: the tokenizer's, when there is one (the vocabulary may be padded)."""
        return self.tokenizer.vocab_size if self.tokenizer is not None else self.vocab_size

    # -------------------------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, offset: int = 0,
                **kwargs) -> tuple[torch.Tensor, Optional[PrefetchedRows]]:
        """The model's output for ``tokens`` [b, s] at positions ``offset..offset+s-1`` (``kwargs`` go to
        ``GPTModel.forward``), and the rows fetched for them with host placement (else None).

        Host placement fetches ``U_l[distinct ids]`` before the forward and re-chooses the cached
        rows after it when due (forward number: ``host_tables.fetch_count``).
        """
        tokens = tokens.to(torch.long)
        if self.host_tables is not None:
            prefetched = self.host_tables.fetch(tokens)  # checks the ids
        else:
            prefetched = None
            check_token_ids(tokens, self.vocab_size)  # before the copy: no wait for the device
        tokens = tokens.to(self.device)
        b, s = tokens.shape
        positions = torch.arange(offset, offset + s, device=self.device).unsqueeze(0).expand(b, s)
        with token_ids(tokens, None, prefetched):
            out = self.model(tokens, positions, None, **kwargs)
        if prefetched is not None:
            self.host_tables.refresh_cache(self.host_tables.fetch_count)
        return out, prefetched

    # -------------------------------------------------------------------------------- scoring
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` LongTensor [B, S] (S <= seq_length) -> float32 logits [B, S, V] on the model's device."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        if tokens.shape[1] > self.seq_length:
            raise ValueError(f"{tokens.shape[1]} tokens exceed model.seq_length={self.seq_length}: "
                             "truncate the input (loglikelihood* truncate contexts from the left)")
        return self.forward(tokens)[0].float()

    def loglikelihood(self, context_ids: Sequence[int], continuation_ids: Sequence[int]) -> tuple[float, bool]:
        """``(sum of log p(continuation | context), whether greedy decoding produces the continuation)``."""
        return self.loglikelihood_batch([(context_ids, continuation_ids)])[0]

    def loglikelihood_batch(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                            batch_size: int = 8) -> list[tuple[float, bool]]:
        """``loglikelihood`` of many (context, continuation) pairs, longest first in padded batches."""
        rows = [self._scoring_row(ctx, cont) for ctx, cont in pairs]
        results: list = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            batch = torch.full((len(chunk), len(rows[chunk[0]][0])), _PAD, dtype=torch.long)
            for r, i in enumerate(chunk):
                batch[r, :len(rows[i][0])] = torch.tensor(rows[i][0])
            logits = self.logits(batch)
            for r, i in enumerate(chunk):
                inputs, continuation = rows[i]
                logprobs = torch.log_softmax(logits[r, len(inputs) - len(continuation):len(inputs)], dim=-1)
                target = torch.tensor(continuation, device=logprobs.device)
                results[i] = (float(logprobs.gather(1, target[:, None]).sum()),
                              bool((logprobs.argmax(dim=-1) == target).all()))
        return results

    def _scoring_row(self, context: Sequence[int], continuation: Sequence[int]) -> tuple[list[int], list[int]]:
        """Model input (context + continuation minus its last token, left-truncated) and the targets."""
        if len(context) == 0:
            raise ValueError("empty context: condition on a prefix token (lm-eval uses the EOD id)")
        if not 1 <= len(continuation) <= self.seq_length:
            raise ValueError(f"continuation of {len(continuation)} tokens: must be 1..seq_length={self.seq_length}")
        ids = (list(context) + list(continuation))[-(self.seq_length + 1):]
        return ids[:-1], list(continuation)

    # ----------------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop: Sequence[str] = (),
                 temperature: float = 0.0, top_p: float = 1.0,
                 generator: Optional[torch.Generator] = None) -> list[int]:
        """New token ids after ``prompt_ids``: greedy (``temperature=0``) or sampled from ``generator``.

        Stops after ``max_new_tokens``, at the EOD token (not returned), or once the decoded output
        contains a ``stop`` string (its tokens are returned; cut the text with the stop string).
        Only ids the tokenizer can decode are generated (the model's vocabulary may be padded).
        """
        if len(prompt_ids) == 0:
            raise ValueError("empty prompt: start from a prefix token (e.g. the EOD id)")
        if stop:
            self.require_tokenizer()  # stop strings are matched on decoded text
        tokens, new = list(prompt_ids), []
        for _ in range(max_new_tokens):
            window = torch.tensor([tokens[-self.seq_length:]])
            token = next_token(self.logits(window)[0, -1, :self.decodable_ids], temperature, top_p, generator)
            if token == self.eod_id:
                break
            tokens.append(token)
            new.append(token)
            if stop and any(s in self.decode(new) for s in stop):
                break
        return new


def build_host_rows_model(cfg: RunConfig, tables: ReadOnlyHostTables) -> GPTModel:
    """The export's single-process model with STEM rows served by ``tables`` (no ``U_l`` parameters).

    Same layout as ``single_process.build_single_process_model`` (TP=PP=EP=1, local modules, fp32);
    the row source is the training path's ``HostRowSource`` with ``tables`` as its store, and its
    parameters are the export's weights minus the tables.
    """
    cfg = single_process_config(cfg)
    ensure_single_process_state(cfg.train.seed)
    config = transformer_config(cfg.model, cfg.parallel, on_gpu=False, use_cpu_initialization=True, stem=cfg.stem,
                                hash_moe=cfg.hash_moe)
    rows = ModuleSpec(module=HostRowSource, params={"store": tables})
    return build_gpt(cfg.model, cfg.stem, config, row_source=rows, use_te=False, pre_process=True, post_process=True,
                     hash_moe=cfg.hash_moe)
