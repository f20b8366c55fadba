"""lm-eval-harness model ``stem``: an export scored and sampled through ``InferenceModel``.

Subclasses lm-eval's ``TemplateLM`` (an ``LM`` that does the harness's own context/continuation
tokenisation: trailing context spaces move to the continuation, an empty context becomes the EOD
prefix token), so the requests our model sees match those of lm-eval's HF causal models.
``lm_eval --model stem --model_args export=DIR`` works once this module is imported (``stem-eval``
does that).
"""

from __future__ import annotations

from typing import Optional

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from stem_megatron.inference.model import InferenceModel


@register_model("stem")
class STEMLM(TemplateLM):
    """``export``: an export directory (or pass a loaded ``model``); ``batch_size`` sequences per forward."""

    def __init__(self, export: Optional[str] = None, model: Optional[InferenceModel] = None, batch_size=8,
                 device: Optional[str] = None, max_gen_toks: int = 256, seed: int = 1234):
        super().__init__()
        if (export is None) == (model is None):
            raise ValueError("give exactly one of export=<export dir> or model=<InferenceModel>")
        if str(batch_size).startswith("auto"):
            raise ValueError("batch_size=auto is not supported by the stem model: give a number")
        self.model = model if model is not None else InferenceModel(export, device=device)
        self.model.require_tokenizer()  # harness requests are text: fail now if the export has no tokenizer
        self.batch_size = int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self._generator = torch.Generator().manual_seed(int(seed))  # for do_sample requests

    @property
    def eot_token_id(self) -> int:
        return self.model.eod_id

    @property
    def max_length(self) -> int:
        return self.model.seq_length

    @property
    def tokenizer_name(self) -> str:
        return str(self.model.export_dir / "tokenizer.json")

    def get_model_info(self) -> dict:
        cfg = self.model.config
        return {"export": str(self.model.export_dir), "model": cfg.model.name, "stem_variant": cfg.stem.variant,
                "stem_ratio": cfg.stem.ratio, "stem_layers": cfg.stem.layers}

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        return self.model.encode(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.model.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``requests``: ``((context, continuation) or None, context ids, continuation ids)``."""
        results = self.model.loglikelihood_batch([(ctx, cont) for _, ctx, cont in requests], self.batch_size)
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood over disjoint windows of ``seq_length`` (lm-eval's rolling scheme:
        every token predicted once, the first from the EOD prefix, later windows with full context)."""
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for window in get_rolling_token_windows(self.tok_encode(string), self.prefix_token_id,
                                                    self.max_length, context_len=1):
                windows.append(make_disjoint_window(window))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self.model.loglikelihood_batch(windows, self.batch_size)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Generation until a stop string, the EOD token or ``max_gen_toks`` (greedy unless do_sample)."""
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="generate_until"):
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(gen_kwargs, default_max_gen_toks=self.max_gen_toks)
            until = kwargs["until"]
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs["do_sample"] else 0.0
            ids = self.model.generate(self.tok_encode(context) or [self.prefix_token_id], kwargs["max_gen_toks"],
                                      stop=until, temperature=temperature, top_p=float(kwargs.get("top_p", 1.0)),
                                      generator=self._generator)
            text = postprocess_generated_text(self.tok_decode(ids), until, None)
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out
