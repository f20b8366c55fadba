"""Progress of a preprocessing job that may run for days: a bar on a terminal, a plain line a minute in a log.

The ETA comes from input bytes (known for every file before the first is read, compressed or not); documents and
tokens are counted as they are written.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

LOG_EVERY_S = 60.0


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
    """``update(read, docs, tokens)`` after each chunk written; ``total_bytes`` of input in this job, of which
    ``done_bytes`` were finished by an earlier run (not counted in the rates)."""

    def __init__(self, total_bytes: int, done_bytes: int = 0, stream=None, log_every_s: float = LOG_EVERY_S):
        self.stream = stream or sys.stderr
        self.total, self.read, self.docs, self.tokens = total_bytes, done_bytes, 0, 0
        self._start_bytes = done_bytes
        self.start = self._logged = time.monotonic()
        self.log_every_s = log_every_s
        self._bar = (tqdm(total=total_bytes, initial=done_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                          desc="stem-preprocess", file=self.stream, dynamic_ncols=True)
                     if self.stream.isatty() else None)

    def update(self, read: int, docs: int, tokens: int) -> None:
        self.read, self.docs, self.tokens = self.read + read, self.docs + docs, self.tokens + tokens
        if self._bar is not None:
            self._bar.update(read)
            self._bar.set_postfix_str(f"{self.docs:,} docs, {self.tokens / 1e6:,.1f}M tokens, "
                                      f"{self.tokens / self.elapsed / 1e6:.2f}M tokens/s", refresh=False)
        elif time.monotonic() - self._logged >= self.log_every_s:
            self._logged = time.monotonic()
            print(self.line(), file=self.stream, flush=True)

    @property
    def elapsed(self) -> float:
        return max(time.monotonic() - self.start, 1e-9)

    def line(self) -> str:
        """One plain progress line: input done, documents, tokens, rates and ETA."""
        rate = (self.read - self._start_bytes) / self.elapsed
        eta = _duration((self.total - self.read) / rate) if rate > 0 else "?"
        return (f"stem-preprocess: {self.read / 1e9:,.2f} of {self.total / 1e9:,.2f} GB input "
                f"({100 * self.read / max(self.total, 1):.0f}%), {self.docs:,} docs, {self.tokens:,} tokens, "
                f"{rate / 1e6:.1f} MB/s, {self.tokens / self.elapsed / 1e6:.2f}M tokens/s, ETA {eta}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
