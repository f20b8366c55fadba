"""Loss-spike detection: flags a step whose loss stands out from the recent non-spike steps.

A step is a spike when its loss exceeds the mean of the previous ``window`` *non-spike* losses by
more than ``k`` of their standard deviations, or when the loss is not finite. Spikes never enter the
statistics, so one spike does not raise the mean/std and mask the next. Before ``warmup`` non-spike
losses have been seen, only non-finite losses are flagged.

``detrend=True`` replaces the window mean by a least-squares quadratic fit of the window's losses
over their index, evaluated one index after the newest, and the standard deviation by the fit's
residual standard deviation widened by the uncertainty of that extrapolation. While the loss still
falls fast, the plain mean lags behind and the trend inflates the standard deviation, so a spike
early in training can stay below ``k``: on a curve ``2 + 3 exp(-t/150)`` with noise, a +1.0 jump at
step 150 is missed by the plain mean and found with ``detrend`` (docs/tracking.md, tests/test_spikes.py).

All statistics are running sums over a deque (O(1) per step). They are kept relative to a shift (the
oldest loss and index of the window) and recomputed exactly from the deque every ``window``
additions, so a long run accumulates no rounding drift; the result depends only on the loss sequence.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Optional

SPIKE_FIELDS = ("loss_spike", "loss_spike_size", "loss_spike_count")


class SpikeDetector:
    """Per-step loss-spike flags to merge into the step record.

    ``update(loss)`` returns ``{"loss_spike": bool, "loss_spike_size": float | None,
    "loss_spike_count": int}``: the size is ``(loss - baseline) / std`` in standard deviations of the
    window, given for flagged finite losses only (``None`` otherwise, also for non-finite losses); the
    count is the number of spikes so far, this step included.

    ``min_std`` floors the standard deviation so a window of (near-)identical losses does not turn a
    rounding-level increase into a spike of infinite size.

    Note: a lasting jump of the loss level (e.g. divergence) keeps being flagged until the loss comes
    back down, because flagged steps are never added to the window.
    """

    def __init__(self, window: int = 100, k: float = 4.0, warmup: int = 20, min_std: float = 1e-6,
                 detrend: bool = False):
        lowest = 5 if detrend else 2  # a quadratic fit needs > 3 points for a residual std
        if window < lowest:
            raise ValueError(f"window={window}: must be >= {lowest}")
        if not lowest <= warmup <= window:
            raise ValueError(f"warmup={warmup}: must be in [{lowest}, window={window}]")
        if k <= 0:
            raise ValueError(f"k={k}: must be > 0")
        self.window, self.k, self.warmup = window, float(k), warmup
        self.min_std, self.detrend = float(min_std), detrend
        self.count = 0
        self._values: deque[tuple[int, float]] = deque()  # (index among accepted losses, loss)
        self._next_index = 0
        self._since_refresh = 0
        self._refresh()

    # -- running sums of the window ------------------------------------------------------------------
    # y = loss - shift_y, u = (index - shift_u) / window; S[k] = sum u^k (k <= 4), T[k] = sum u^k y
    # (k <= 2), Q = sum y^2. The plain mean/std use S[0], T[0], Q only.

    def _refresh(self) -> None:
        """Recompute the sums exactly around the oldest point of the window."""
        self._shift_u, self._shift_y = self._values[0] if self._values else (self._next_index, 0.0)
        self._S, self._T, self._Q = [0.0] * 5, [0.0] * 3, 0.0
        for i, x in self._values:
            self._accumulate(i, x, 1.0)
        self._since_refresh = 0

    def _accumulate(self, i: int, x: float, sign: float) -> None:
        u, y = (i - self._shift_u) / self.window, x - self._shift_y
        p = 1.0
        for k in range(5):
            self._S[k] += sign * p
            if k < 3:
                self._T[k] += sign * p * y
            p *= u
        self._Q += sign * y * y

    def _add(self, x: float) -> None:
        if not self._values:
            self._shift_u, self._shift_y = self._next_index, x
        self._values.append((self._next_index, x))
        self._accumulate(self._next_index, x, 1.0)
        self._next_index += 1
        if len(self._values) > self.window:
            self._accumulate(*self._values.popleft(), -1.0)
        self._since_refresh += 1
        if self._since_refresh >= self.window:
            self._refresh()

    @property
    def n(self) -> int:
        """Number of non-spike losses in the window."""
        return len(self._values)

    def baseline(self) -> tuple[Optional[float], Optional[float]]:
        """Expected next loss and its standard deviation (floored at ``min_std``) from the window:
        the mean and sample std, or with ``detrend`` the quadratic fit's prediction and the standard
        deviation of a new loss around it (residual std times ``sqrt(1 + leverage)`` of the new index).
        ``(None, None)`` while the window is too small."""
        n = len(self._values)
        if n < (4 if self.detrend else 2):
            return None, None
        S, T, Q = self._S, self._T, self._Q
        if not self.detrend:
            mean_y = T[0] / n
            var = max(Q - n * mean_y * mean_y, 0.0) / (n - 1)
            return self._shift_y + mean_y, max(math.sqrt(var), self.min_std)
        gram = [[S[0], S[1], S[2]], [S[1], S[2], S[3]], [S[2], S[3], S[4]]]
        coef = _solve3(gram, T)
        u = (self._next_index - self._shift_u) / self.window
        x0 = [1.0, u, u * u]
        lever = _solve3(gram, x0)
        if coef is None or lever is None:  # degenerate (not for >= 3 distinct indices): use the mean
            coef, leverage = [T[0] / n, 0.0, 0.0], 1.0 / n
        else:
            leverage = max(sum(a * b for a, b in zip(x0, lever)), 0.0)
        rss = max(Q - sum(c * t for c, t in zip(coef, T)), 0.0)
        pred = coef[0] + coef[1] * u + coef[2] * u * u
        # std of the next loss around the prediction: residual std x sqrt(1 + leverage of the new point)
        return self._shift_y + pred, max(math.sqrt(rss / (n - 3) * (1.0 + leverage)), self.min_std)

    def mean_std(self) -> tuple[Optional[float], Optional[float]]:
        """Alias of ``baseline()`` (the window mean and std unless ``detrend``)."""
        return self.baseline()

    # -- the per-step call --------------------------------------------------------------------------
    def update(self, loss: Optional[float]) -> dict:
        """Classify this step's loss; adds it to the window unless it is a spike."""
        loss = float("nan") if loss is None else float(loss)
        if not math.isfinite(loss):
            self.count += 1
            return {"loss_spike": True, "loss_spike_size": None, "loss_spike_count": self.count}
        if len(self._values) >= self.warmup:
            center, std = self.baseline()
            z = (loss - center) / std
            if z > self.k:
                self.count += 1
                return {"loss_spike": True, "loss_spike_size": z, "loss_spike_count": self.count}
        self._add(loss)
        return {"loss_spike": False, "loss_spike_size": None, "loss_spike_count": self.count}

    def state_dict(self) -> dict:
        """Everything needed to continue identically after a checkpoint restart."""
        return {"window": self.window, "k": self.k, "warmup": self.warmup, "min_std": self.min_std,
                "detrend": self.detrend, "count": self.count, "values": [list(v) for v in self._values],
                "next_index": self._next_index, "since_refresh": self._since_refresh,
                "shift": [self._shift_u, self._shift_y], "S": list(self._S), "T": list(self._T), "Q": self._Q}

    def load_state_dict(self, state: dict) -> None:
        self.window, self.k, self.warmup = state["window"], state["k"], state["warmup"]
        self.min_std, self.detrend, self.count = state["min_std"], state["detrend"], state["count"]
        self._values = deque((int(i), float(x)) for i, x in state["values"])
        self._next_index, self._since_refresh = state["next_index"], state["since_refresh"]
        self._shift_u, self._shift_y = state["shift"]
        self._S, self._T, self._Q = list(state["S"]), list(state["T"]), state["Q"]


def _solve3(a: list[list[float]], b: list[float]) -> Optional[list[float]]:
    """Solve the 3x3 system ``a x = b`` (Gaussian elimination with partial pivoting)."""
    m = [row[:] + [bi] for row, bi in zip(a, b)]
    for col in range(3):
        piv = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, 3):
            f = m[r][col] / m[col][col]
            for c in range(col, 4):
                m[r][c] -= f * m[col][c]
    x = [0.0] * 3
    for r in (2, 1, 0):
        x[r] = (m[r][3] - sum(m[r][c] * x[c] for c in range(r + 1, 3))) / m[r][r]
    return x


def spike_steps(records) -> list[tuple[int, Optional[float]]]:
    """``(step, size)`` of the flagged steps in a sequence of step records (e.g. metrics.jsonl)."""
    return [(r["step"], r.get("loss_spike_size")) for r in records if r.get("loss_spike")]
