"""Scoring a model on the synthetic facts of ``data.facts``: does it recall each subject's answer, and
does swapping two subjects' STEM rows swap their answers (paper Fig. 5)."""

from __future__ import annotations

import random
from collections import Counter
from typing import Sequence

import torch

from stem_megatron.data.facts import Facts
from stem_megatron.edit.edits import StemEditor


@torch.no_grad()
def answer_logits(model, facts: Facts, subjects: Sequence[str], batch_size: int = 64) -> torch.Tensor:
    """Next-token logits [len(subjects), V] after ``facts.prompt(x)`` (``model``: an ``InferenceModel``)."""
    rows = [model.encode(facts.prompt(x)) for x in subjects]
    out = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        batch = torch.zeros(len(chunk), max(len(r) for r in chunk), dtype=torch.long)
        for i, r in enumerate(chunk):
            batch[i, :len(r)] = torch.tensor(r)
        logits = model.logits(batch)
        out += [logits[i, len(r) - 1] for i, r in enumerate(chunk)]
    return torch.stack(out)


def fact_recall(model, facts: Facts) -> dict:
    """Share of subjects whose top-1 continuation is their answer; ``recalled`` lists them. ``majority`` is
    what always answering the most common answer scores (a model that learned the answers but not the facts)."""
    subjects = list(facts.answer)
    top1 = answer_logits(model, facts, subjects).argmax(-1).tolist()
    recalled = [x for x, t in zip(subjects, top1) if t == facts.answer_id[facts.answer[x]]]
    majority = max(Counter(facts.answer.values()).values()) / len(subjects)
    return {"recall": len(recalled) / len(subjects), "subjects": len(subjects), "recalled": recalled,
            "majority": majority}


def edit_success(model, facts: Facts, recalled: Sequence[str], pairs: int = 100, seed: int = 0,
                 layers=None) -> dict:
    """Swap the STEM rows of two recalled subjects with different answers (paper Fig. 5) and score each
    prompt on the edited model: ``edit_success`` its top-1 is now the other subject's answer,
    ``edit_flips`` the other answer is now more likely than its own, ``edit_stays`` its top-1 is still
    its own answer. Every swap is undone before the next."""
    rng = random.Random(seed)
    recalled = list(recalled)
    chosen = []
    for _ in range(pairs * 20):
        if len(chosen) == pairs or len(recalled) < 2:
            break
        a, b = rng.sample(recalled, 2)
        if facts.answer[a] != facts.answer[b]:
            chosen.append((a, b))
    if not chosen:
        return {"edit_success": None, "edit_flips": None, "edit_stays": None, "pairs": 0}
    editor = StemEditor.from_model(model)
    moved = flipped = stayed = 0
    for a, b in chosen:
        with editor.session():
            editor.swap_rows([facts.subject_id[a]], [facts.subject_id[b]], layers=layers)
            logits = answer_logits(model, facts, [a, b])
        for row, own, other in ((logits[0], a, b), (logits[1], b, a)):
            own_id, other_id = facts.answer_id[facts.answer[own]], facts.answer_id[facts.answer[other]]
            top = int(row.argmax())
            moved, stayed = moved + (top == other_id), stayed + (top == own_id)
            flipped += bool(row[other_id] > row[own_id])
    n = 2 * len(chosen)
    return {"edit_success": moved / n, "edit_flips": flipped / n, "edit_stays": stayed / n, "pairs": len(chosen)}
