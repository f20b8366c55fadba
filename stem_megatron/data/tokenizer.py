"""The project's tokenizer: a byte-level BPE ``tokenizer.json`` (HF ``tokenizers``) as a megatron tokenizer.

megatron-core 0.16 renamed ``datasets.megatron_tokenizer.MegatronTokenizer`` to ``MegatronLegacyTokenizer``
(deprecated, warns on every construction); its datasets now take a ``tokenizers.MegatronTokenizerBase``,
so that is the base here. ``GPTDataset`` reads ``eod`` (document boundaries for masks and position
resets), ``pad`` and ``vocab_size``, and hashes ``unique_identifiers`` into its index cache names;
evaluation encodes and decodes text through the same object.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
from megatron.core.datasets.megatron_dataset import _PAD_TOKEN_ID
from megatron.core.tokenizers import MegatronTokenizerBase
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOD_TOKEN = "<|endoftext|>"  # ours (train_tokenizer) and Qwen2's
EOD_TOKENS = (EOD_TOKEN, "<|end_of_text|>")  # the end-of-document tokens a tokenizer may have: Llama 3's second


def train_tokenizer(docs, vocab_size, path):
    """Train a byte-level BPE tokenizer on ``docs`` and save it to ``path`` (tokenizer.json).

    Byte-level BPE never produces unknown tokens and decodes back to the exact input text.
    ``EOD_TOKEN`` is the first special token, so it gets id 0.
    """
    if vocab_size <= 256:
        raise ValueError(f"vocab_size {vocab_size} must exceed the 256-byte alphabet plus {EOD_TOKEN}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer=trainer)
    assert tokenizer.token_to_id(EOD_TOKEN) == 0
    tokenizer.save(str(path))
    return tokenizer


class HFTokenizer(MegatronTokenizerBase):
    """A ``tokenizer.json`` with an ``<|endoftext|>`` token, usable by megatron's datasets and by evaluation."""

    def __init__(self, path):
        path = Path(path).resolve()
        if not path.is_file():
            raise FileNotFoundError(
                f"tokenizer {path} not found: build it with `stem-preprocess --vocab-size N ...` or "
                f"`python -m stem_megatron.data.corpus --out {path.parent}`"
            )
        super().__init__(str(path), {})
        self._tokenizer = Tokenizer.from_file(str(path))
        found = [token for token in EOD_TOKENS if self._tokenizer.token_to_id(token) is not None]
        if not found:
            raise ValueError(f"tokenizer {path} has none of the end-of-document tokens {EOD_TOKENS}, one of which "
                             f"separates documents; retrain it with stem-preprocess --vocab-size N")
        self.eod_token = found[0]
        self._eod = self._tokenizer.token_to_id(self.eod_token)

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """Many documents at once (the Rust encoder runs them in parallel)."""
        return [e.ids for e in self._tokenizer.encode_batch(texts)]

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode(np.asarray(ids, dtype=np.int64).tolist())

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("base-model pretraining tokenizer: it has no chat template")

    @property
    def vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: token for token, i in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        """The tokenizer's padding id if it defines one, else megatron's "no pad token" sentinel (-1).

        Our tokenizers have none; padded positions (only a last partial validation sample) are then
        loss-masked and mapped to id 0 by ``GPTDataset``. Reusing EOD as pad would make megatron
        mask real EODs.
        """
        padding = self._tokenizer.padding
        return padding["pad_id"] if padding else _PAD_TOKEN_ID

    @property
    def unique_identifiers(self) -> OrderedDict:
        """What megatron hashes into its dataset index cache names."""
        return OrderedDict(cls=f"{type(self).__module__}.{type(self).__qualname__}", path=self.path)
