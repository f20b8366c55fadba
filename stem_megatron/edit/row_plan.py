"""Token-length mismatch strategies: which target rows each source token's row becomes.

A knowledge edit ``e_src <- e_tgt`` (paper §5.2) rewrites the STEM rows of the *source* word's token
ids with rows built from the *target* word's token ids; the prompt is never changed. When the two
words tokenize to different numbers of tokens ("France" = 1 token, "United States" = 2 in the
paper's slides, "Hacking the Token Length Mismatch") the n_src source positions have to be given
rows built from n_tgt target rows. The slides name three strategies and show them only as figures;
our reading, made precise (``plan_rows``):

``filler``   position-wise: source token i gets target token i's row. If the target is shorter, the
             surplus source positions get the row of a *filler* token (a semantically empty token,
             by default the EOD id; ``stem-edit --filler " the"`` picks another). If the target is
             longer, the surplus target tokens are left out (listed in ``RowPlan.dropped``).
``clone``    position-wise, but a shorter target's *last* token row is repeated (cloned) into every
             surplus source position; a longer target keeps its first n_src-1 rows and puts its last
             token's row on the last source position (the word's last token is where factual recall
             concentrates, Meng et al. 2022), dropping the middle ones.
``average``  the longer word's positions are split into as many contiguous, near-equal groups as the
             shorter word has positions (``numpy.array_split``). Target longer: each source position
             gets the mean of its group's target rows ("United States" -> mean of both rows on
             "France"). Target shorter: every source position of group k gets target row k.

With equal lengths all three are the plain position-wise ``e_src[i] <- e_tgt[i]``.
A plan is a list of ``(source id, {row id: weight})``: each edited row is a weighted sum of rows of
the *unedited* tables (weights sum to 1), so one plan serves every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

STRATEGIES = ("filler", "clone", "average")


@dataclass
class RowPlan:
    """``assignments[i] = (destination id, {source row id: weight})``; ``dropped``: target ids not used."""

    assignments: list[tuple[int, dict[int, float]]]
    strategy: str
    dropped: list[int] = field(default_factory=list)
    filler: Optional[int] = None  # the filler id when a row of it is used (never written by a swap)

    @property
    def destination_ids(self) -> list[int]:
        return [dst for dst, _ in self.assignments]

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "dropped": self.dropped, "filler": self.filler,
                "assignments": [[dst, {str(k): v for k, v in mix.items()}] for dst, mix in self.assignments]}


def plan_rows(source_ids: Sequence[int], target_ids: Sequence[int], strategy: str = "filler",
              filler_id: int = 0) -> RowPlan:
    """The rows the source word's ids get from the target word's ids under ``strategy`` (module doc)."""
    src, tgt = [int(i) for i in source_ids], [int(i) for i in target_ids]
    if not src or not tgt:
        raise ValueError(f"source ids {src} and target ids {tgt} must both be non-empty")
    if strategy not in STRATEGIES:
        raise ValueError(f"length strategy {strategy!r} is not one of {STRATEGIES}")
    n_src, n_tgt = len(src), len(tgt)
    dropped: list[int] = []
    if n_src == n_tgt:
        mixes = [{t: 1.0} for t in tgt]
    elif strategy == "filler":
        mixes = [{tgt[i]: 1.0} if i < n_tgt else {int(filler_id): 1.0} for i in range(n_src)]
        dropped = tgt[n_src:]
    elif strategy == "clone":
        if n_tgt < n_src:
            mixes = [{tgt[min(i, n_tgt - 1)]: 1.0} for i in range(n_src)]
        else:
            mixes = [{t: 1.0} for t in tgt[:n_src - 1]] + [{tgt[-1]: 1.0}]
            dropped = tgt[n_src - 1:-1]
    else:  # average
        if n_tgt > n_src:
            mixes = []
            for group in np.array_split(np.arange(n_tgt), n_src):
                mix: dict[int, float] = {}
                for j in group:
                    mix[tgt[j]] = mix.get(tgt[j], 0.0) + 1.0 / len(group)
                mixes.append(mix)
        else:
            mixes = [None] * n_src
            for k, group in enumerate(np.array_split(np.arange(n_src), n_tgt)):
                for i in group:
                    mixes[i] = {tgt[k]: 1.0}
    assignments = [(s, m) for s, m in zip(src, mixes)]
    filler = int(filler_id) if strategy == "filler" and n_tgt < n_src else None
    return RowPlan(_merge_duplicates(assignments), strategy, dropped, filler)


def _merge_duplicates(assignments):
    """A source id that occurs twice in the word must get one row: identical mixes merge, others fail."""
    seen: dict[int, dict[int, float]] = {}
    out = []
    for dst, mix in assignments:
        if dst in seen:
            if seen[dst] != mix:
                raise ValueError(f"token id {dst} occurs twice in the source word and would need two different "
                                 f"rows ({seen[dst]} and {mix}): edit a word without repeated tokens")
            continue
        seen[dst] = mix
        out.append((dst, mix))
    return out
