"""``data.blend`` entries that name many datasets: a directory (every ``*.idx`` prefix in it) or a glob
(``dclm/train-*``, matched against ``.idx`` files), as preprocessing across nodes writes its parts
``PREFIX-NNNNN-of-MMMMM``, so a run trains on hundreds of parts without listing them.

An entry's weight is split among its prefixes in proportion to their token counts, so the parts weigh as one
dataset of their union would; megatron then gets the expanded ``(weight, prefix)`` pairs. Weights stay explicit:
a glob across directories (``*/train-*``) already weighs several sources by their tokens.
"""

from __future__ import annotations

import glob
from pathlib import Path

from stem_megatron.data.integrity import DataError, token_count

FIX = "correct the pattern or data.dir, or write the parts there with stem-preprocess"


class BlendError(DataError):
    """A ``data.blend`` entry that names no dataset; ``field`` is the entry, ``data.blend[i]``."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _matches(pattern: str, data_dir) -> tuple[str, list[str]] | None:
    """The ``.idx`` glob ``pattern`` stands for and the prefixes it matches, sorted; None for one plain prefix."""
    path = Path(data_dir) / pattern  # an absolute pattern stays as it is
    if Path(f"{path}.idx").is_file():
        return None
    if path.is_dir() or pattern.endswith("/"):
        searched = str(path / "*.idx")
    elif any(c in pattern for c in "*?["):
        searched = str(path) if pattern.endswith(".idx") else f"{path}.idx"
    else:
        return None
    return searched, sorted(name[: -len(".idx")] for name in glob.glob(searched) if Path(name).is_file())


def expand_blend(blend: list, data_dir) -> list[tuple[float, str]]:
    """``(weight, prefix path)`` pairs of ``blend`` (``[[weight, prefix | directory | glob], ...]``, relative to
    ``data_dir`` unless absolute): a directory or glob entry becomes its prefixes, its weight split by their tokens."""
    pairs = []
    for i, (weight, pattern) in enumerate(blend):
        matched = _matches(pattern, data_dir)
        if matched is None:
            pairs.append((weight, str(Path(data_dir) / pattern)))
            continue
        searched, prefixes = matched
        if not prefixes:
            raise BlendError(f"data.blend[{i}]", f"{pattern!r} matches no .idx file (searched {searched}): {FIX}")
        try:
            tokens = [token_count(prefix) for prefix in prefixes]
        except DataError as e:
            raise BlendError(f"data.blend[{i}]", str(e)) from None
        if sum(tokens) == 0:
            raise BlendError(f"data.blend[{i}]", f"{pattern!r} matches empty datasets only (searched {searched}): "
                                                 f"{FIX}")
        pairs += [(weight * n / sum(tokens), prefix) for n, prefix in zip(tokens, prefixes) if n]
    return pairs
