"""``InferenceModel``: an export loaded into one process for scoring and generation.

Scoring follows lm-eval's causal-LM conventions: a context longer than ``model.seq_length`` loses
its oldest tokens, a continuation is scored from the logits that predict it. Batches are padded on
the right, which causal attention keeps invisible to every real position. Generation recomputes the
last ``seq_length`` tokens for every new token (no KV cache yet).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch

from stem_megatron.data.tokenizer import HFTokenizer
from stem_megatron.export.format import ExportError, read_export
from stem_megatron.inference.sampling import next_token
from stem_megatron.export.single_process import build_single_process_model
from stem_megatron.model.sharding import load_full_weights
from stem_megatron.model.token_context import token_ids

_PAD = 0  # any valid id: right padding is never attended to by real positions


class InferenceModel:
    """The export's single-process GPT model, its tokenizer (if exported) and scoring/generation on them."""

    def __init__(self, export_dir, device: Optional[str] = None):
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
        model = build_single_process_model(self.config)
        load_full_weights(model, weights)
        self.model = model.to(self.device).eval()

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

    # -------------------------------------------------------------------------------- scoring
    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` LongTensor [B, S] (S <= seq_length) -> float32 logits [B, S, V] on the model's device."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        if tokens.shape[1] > self.seq_length:
            raise ValueError(f"{tokens.shape[1]} tokens exceed model.seq_length={self.seq_length}: "
                             "truncate the input (loglikelihood* truncate contexts from the left)")
        tokens = tokens.to(self.device, torch.long)
        positions = torch.arange(tokens.shape[1], device=self.device).unsqueeze(0).expand_as(tokens)
        with token_ids(tokens, self.vocab_size):
            return self.model(tokens, positions, None).float()

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
        decodable = self.tokenizer.vocab_size if self.tokenizer is not None else self.vocab_size
        tokens, new = list(prompt_ids), []
        for _ in range(max_new_tokens):
            window = torch.tensor([tokens[-self.seq_length:]])
            token = next_token(self.logits(window)[0, -1, :decodable], temperature, top_p, generator)
            if token == self.eod_id:
                break
            tokens.append(token)
            new.append(token)
            if stop and any(s in self.decode(new) for s in stop):
                break
        return new
