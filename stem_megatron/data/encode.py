"""A chunk of raw records -> its documents' tokens, each followed by EOD: the work a preprocessing worker does.

Parsing (JSON, UTF-8: ``documents.decode_chunk``) and tokenizing happen here, in the worker, so that the reading
process stays light and the work spreads over every core. A worker tokenizes on its own core (``TOKENIZERS_PARALLELISM=false``: N workers are
N busy cores, not N thread pools competing); one worker is the preprocessing process itself.
"""

from __future__ import annotations

import os
import signal

import numpy as np
from tokenizers import Tokenizer

from stem_megatron.child_processes import die_with_parent
from stem_megatron.data.documents import Chunk, decode_chunk

_encoder = None  # this process's (tokenizer, eod id, dtype, text_key), set by ``start``


def start(tokenizer_path: str, eod: int, dtype, text_key: str) -> None:
    """Load the tokenizer into this process (a worker's initializer, or the process itself for one worker)."""
    global _encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _encoder = (Tokenizer.from_file(tokenizer_path), eod, dtype, text_key)


def start_worker(parent: int, *args) -> None:
    """A worker process's initializer: it dies with the preprocessing process ``parent``, however that ends, and
    leaves Ctrl-C to it (which stops the pool)."""
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    start(*args)


def encode(chunk: Chunk) -> tuple[np.ndarray, np.ndarray, list[str], int]:
    """``(tokens, lengths, bad, read)``: the documents' ids, EOD after each, in one array of the dataset's dtype,
    each document's length, the messages of records without text, and the chunk's input bytes."""
    tokenizer, eod, dtype, text_key = _encoder
    texts, bad = decode_chunk(chunk, text_key)
    ids = [encoding.ids for encoding in tokenizer.encode_batch_fast(texts)]  # no offsets: ids only
    lengths = np.fromiter((len(doc) + 1 for doc in ids), dtype=np.int64, count=len(ids))
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths)
    for doc, end in zip(ids, ends):
        tokens[end - len(doc) - 1: end - 1] = doc
    tokens[ends - 1] = eod
    return tokens, lengths, bad, chunk.read
