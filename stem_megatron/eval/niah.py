"""Needle-in-a-Haystack: can the model retrieve one fact placed at a given depth of a long context?

A prompt of exactly ``length`` tokens is haystack text (from a local corpus) with the needle sentence
"The special magic number is N." inserted at ``depth`` (0 = start, 1 = just before the question) of
the haystack, moved to the nearest sentence end (else word start) within ``boundary_window(...)``
tokens, then the question. Prompts are built in token space, so the budget is exact. A case scores 1
when the first number the model generates is N; the log-likelihood of " N" after the prompt is
reported too (it moves before accuracy does on small models). Results are a length x depth grid.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

NEEDLE = " The special magic number is {number}."
QUESTION = "\nWhat is the special magic number? The special magic number is"
_SENTENCE_END = re.compile(r"[.!?]\s*$|\n\s*$")


@dataclass
class NeedleCase:
    length: int
    depth: float
    number: str
    prompt_ids: list[int]
    answer_ids: list[int]  # " <number>" after the prompt
    needle_start: int  # token offset of the needle in the prompt (= in the haystack part)
    needle_tokens: int
    haystack_tokens: int  # haystack tokens in the prompt (the depth is a fraction of these)


def haystack_ids(source, tokenizer) -> list[int]:
    """Token ids of the haystack: a text file, an indexed-dataset prefix (documents decoded and re-joined
    as text, EOD dropped), or a list of document strings. ``tokenizer``: ``tokenize``/``detokenize``."""
    if isinstance(source, (list, tuple)):
        docs = list(source)
    elif Path(f"{source}.idx").is_file():
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        dataset = IndexedDataset(str(source), mmap=True)
        docs = [tokenizer.detokenize([int(t) for t in dataset[i] if int(t) != tokenizer.eod])
                for i in range(len(dataset))]
    elif Path(source).is_file():
        docs = [Path(source).read_text(encoding="utf-8")]
    else:
        raise FileNotFoundError(f"haystack {source} is neither a text file nor an indexed dataset prefix "
                                "(<prefix>.bin/.idx)")
    ids = tokenizer.tokenize("\n\n".join(d.strip() for d in docs if d.strip()))
    if not ids:
        raise ValueError(f"haystack {source} has no text")
    return ids


def boundary_window(haystack_tokens: int) -> int:
    """How far (in tokens) the needle may move from its exact depth to reach a sentence/word boundary."""
    return max(4, haystack_tokens // 20)


def _insert_position(hay: list[int], target: int, tokenizer) -> int:
    """Nearest sentence boundary to ``target`` within the window, else the nearest word start, else target."""
    if target <= 0 or target >= len(hay):
        return max(0, min(target, len(hay)))
    window = boundary_window(len(hay))
    candidates = sorted(range(max(1, target - window), min(len(hay), target + window) + 1),
                        key=lambda p: abs(p - target))
    for p in candidates:
        if p == len(hay) or _SENTENCE_END.search(tokenizer.detokenize([hay[p - 1]])):
            return p
    for p in candidates:
        if p == len(hay) or tokenizer.detokenize([hay[p]])[:1].isspace():
            return p
    return target


def make_case(tokenizer, haystack: Sequence[int], length: int, depth: float, number: str,
              offset: int = 0) -> NeedleCase:
    """One prompt of ``length`` tokens; the haystack is read cyclically from token ``offset``."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth} must be in [0, 1]")
    needle = tokenizer.tokenize(NEEDLE.format(number=number))
    question = tokenizer.tokenize(QUESTION)
    budget = length - len(needle) - len(question)
    if budget < 1:
        raise ValueError(f"length {length} leaves no room for haystack: the needle and question take "
                         f"{len(needle) + len(question)} tokens")
    hay = [haystack[(offset + i) % len(haystack)] for i in range(budget)]
    pos = _insert_position(hay, round(depth * budget), tokenizer)
    return NeedleCase(length, depth, number, hay[:pos] + needle + hay[pos:] + question,
                      tokenizer.tokenize(f" {number}"), pos, len(needle), budget)


def make_cases(tokenizer, haystack: Sequence[int], lengths: Sequence[int], depths: Sequence[float],
               samples: int = 1, seed: int = 0) -> list[NeedleCase]:
    """``samples`` cases per (length, depth), each with its own 5-digit number and haystack offset."""
    rng = random.Random(seed)
    return [make_case(tokenizer, haystack, length, depth, str(rng.randint(10000, 99999)), rng.randrange(len(haystack)))
            for length in lengths for depth in depths for _ in range(samples)]


def first_number(text: str) -> Optional[str]:
    match = re.search(r"\d+", text)
    return match.group(0) if match else None


def score_cases(cases: Sequence[NeedleCase], generate: Callable[[list[int]], str],
                loglikelihood: Optional[Callable[[list[int], list[int]], tuple[float, bool]]] = None) -> dict:
    """Run ``generate(prompt_ids) -> text`` (and ``loglikelihood(context, continuation)``) on every case;
    returns the grid (rows: lengths, columns: depths, means over samples) and per-case records."""
    lengths = sorted({c.length for c in cases})
    depths = sorted({c.depth for c in cases})
    records = []
    for case in cases:
        text = generate(case.prompt_ids)
        predicted = first_number(text)
        record = {k: v for k, v in asdict(case).items() if k not in ("prompt_ids", "answer_ids")}
        record.update(generation=text, predicted=predicted, correct=int(predicted == case.number))
        if loglikelihood is not None:
            record["answer_logprob"], record["answer_greedy"] = loglikelihood(case.prompt_ids, case.answer_ids)
        records.append(record)

    def grid(key):
        return [[float(np.mean([r[key] for r in records if r["length"] == n and r["depth"] == d]))
                 for d in depths] for n in lengths]

    results = {"lengths": lengths, "depths": depths, "accuracy": grid("correct"),
               "mean_accuracy": float(np.mean([r["correct"] for r in records])), "cases": records}
    if loglikelihood is not None:
        results["answer_logprob"] = grid("answer_logprob")
    return results


def run_niah(model, haystack: Sequence[int], lengths: Sequence[int], depths: Sequence[float], samples: int = 1,
             max_new_tokens: int = 8, seed: int = 0) -> dict:
    """NIAH on an ``InferenceModel`` with greedy generation; every prompt plus its answer fits the context."""
    too_long = [n for n in lengths if n + max_new_tokens > model.seq_length]
    if too_long:
        raise ValueError(f"NIAH lengths {too_long} + max_new_tokens={max_new_tokens} exceed model.seq_length="
                         f"{model.seq_length}: use lengths <= {model.seq_length - max_new_tokens}")
    cases = make_cases(model.require_tokenizer(), haystack, lengths, depths, samples, seed)
    return score_cases(cases, lambda ids: model.decode(model.generate(ids, max_new_tokens, stop=["\n"])),
                       model.loglikelihood)


def plot_heatmap(results: dict, path) -> None:
    """Accuracy heat map: depth (rows, top = 0) by context length (columns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = np.array(results["accuracy"]).T  # [depth, length]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.5 + 0.8 * acc.shape[1]), max(3.0, 1.0 + 0.5 * acc.shape[0])))
    image = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(results["lengths"])), [str(n) for n in results["lengths"]])
    ax.set_yticks(range(len(results["depths"])), [f"{d:g}" for d in results["depths"]])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title("NIAH retrieval accuracy")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
