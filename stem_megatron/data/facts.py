"""Synthetic facts ("The capital of X is Y.") for measuring stored knowledge and knowledge edits.

Subjects and answers are words the corpus tokenizer keeps as one token (`` X``, `` Y``), so a
subject owns exactly one STEM row per layer, as "Spain" does in the paper's Fig. 5, and an answer is
one next-token prediction. Each subject has one answer drawn at random; documents list facts in
random order, every subject ``repeats`` times over the corpus. ``build_facts`` writes the corpus as a
megatron indexed dataset with the corpus tokenizer (so it blends with real text through
``data.blend``) and ``<prefix>.json`` with the facts, which ``eval.facts.fact_recall`` and
``eval.facts.edit_success`` score against.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from stem_megatron.data.preprocess import write_indexed_dataset
from stem_megatron.data.tokenizer import HFTokenizer

TEMPLATE = "The capital of {x} is {y}."
FACTS_FORMAT = "stem-megatron-facts-v1"
_WORD = re.compile(r"[A-Za-z]{4,}")


@dataclass
class Facts:
    """``answer[x]`` for every subject word ``x``, with their token ids under ``tokenizer``."""

    answer: dict[str, str]
    subject_id: dict[str, int]
    answer_id: dict[str, int]

    def prompt(self, x: str) -> str:
        return TEMPLATE.format(x=x, y="").rstrip(" .")

    def to_dict(self) -> dict:
        return {"format": FACTS_FORMAT, "template": TEMPLATE, "answer": self.answer,
                "subject_id": self.subject_id, "answer_id": self.answer_id}

    @classmethod
    def load(cls, path) -> "Facts":
        data = json.loads(Path(path).read_text())
        if data.get("format") != FACTS_FORMAT or data.get("template") != TEMPLATE:
            raise ValueError(f"{path} is not a {FACTS_FORMAT} file with template {TEMPLATE!r}: rebuild it with "
                             f"python -m stem_megatron.data.facts")
        return cls(data["answer"], data["subject_id"], data["answer_id"])


def single_token_words(tokenizer: HFTokenizer) -> list[str]:
    """Alphabetic words of 4+ letters that the tokenizer encodes, after a space, as one token; sorted."""
    words = []
    for word in sorted({tok[1:] for tok in tokenizer.vocab if tok.startswith("Ġ") and _WORD.fullmatch(tok[1:])}):
        if len(tokenizer.tokenize(" " + word)) == 1:
            words.append(word)
    return words


def make_facts(tokenizer: HFTokenizer, num_subjects: int, num_answers: int, seed: int = 0) -> Facts:
    """``num_subjects`` subjects, each with one of ``num_answers`` answers, from disjoint single-token words."""
    words = single_token_words(tokenizer)
    if num_subjects + num_answers > len(words):
        raise ValueError(f"{num_subjects} subjects + {num_answers} answers need that many single-token words, the "
                         f"tokenizer has {len(words)}: lower --subjects/--answers")
    rng = random.Random(seed)
    rng.shuffle(words)
    answers, subjects = words[:num_answers], words[num_answers:num_answers + num_subjects]
    answer = {x: rng.choice(answers) for x in subjects}
    ids = {w: tokenizer.tokenize(" " + w)[0] for w in subjects + answers}
    return Facts(answer, {x: ids[x] for x in subjects}, {y: ids[y] for y in answers})


def fact_documents(facts: Facts, repeats: int, facts_per_doc: int, seed: int = 0) -> list[str]:
    """Every fact ``repeats`` times, shuffled, ``facts_per_doc`` lines per document."""
    lines = [TEMPLATE.format(x=x, y=y) for x, y in facts.answer.items()] * repeats
    random.Random(seed).shuffle(lines)
    return ["\n".join(lines[i:i + facts_per_doc]) for i in range(0, len(lines), facts_per_doc)]


def build_facts(tokenizer_path, prefix, num_subjects: int = 600, num_answers: int = 32, repeats: int = 40,
                facts_per_doc: int = 24, seed: int = 0) -> dict:
    """Write ``prefix.{bin,idx}`` (the fact documents) and ``prefix.json`` (the facts); returns counts."""
    tokenizer = HFTokenizer(tokenizer_path)
    facts = make_facts(tokenizer, num_subjects, num_answers, seed)
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    stats = write_indexed_dataset(fact_documents(facts, repeats, facts_per_doc, seed), tokenizer, prefix)
    prefix.with_suffix(".json").write_text(json.dumps(facts.to_dict(), indent=1))
    return {**stats, "subjects": num_subjects, "answers": num_answers}


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stem_megatron.data.facts", description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default="data_cache/python-doc/tokenizer.json")
    parser.add_argument("--output-prefix", default="data_cache/python-doc/facts")
    parser.add_argument("--subjects", type=int, default=600)
    parser.add_argument("--answers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=40, help="occurrences of every fact in the corpus")
    parser.add_argument("--facts-per-doc", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        stats = build_facts(args.tokenizer, args.output_prefix, args.subjects, args.answers, args.repeats,
                            args.facts_per_doc, args.seed)
    except (ValueError, OSError) as e:
        parser.exit(2, f"facts: error: {e}\n")
    print(f"{args.output_prefix}: {stats['subjects']} facts x {args.repeats}, {stats['docs']} documents, "
          f"{stats['tokens']:,} tokens")


if __name__ == "__main__":
    main()
