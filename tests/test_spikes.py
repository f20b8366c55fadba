"""SpikeDetector: injected spikes found, none on the clean curve, counts, non-finite losses, O(1) sums."""

import math
import random

import numpy as np
import pytest

from stem_megatron.training.spikes import SpikeDetector, spike_steps

JUMPS = (250, 500, 750)


def curve(steps=1000, tau=1000.0, sigma=0.02, seed=0):
    """A smooth decaying loss with Gaussian noise: 2 + 3 exp(-t / tau) + N(0, sigma)."""
    rng = random.Random(seed)
    return [2.0 + 3.0 * math.exp(-t / tau) + rng.gauss(0.0, sigma) for t in range(steps)]


def flagged(losses, **kw):
    det = SpikeDetector(**kw)
    return [t for t, x in enumerate(losses) if det.update(x)["loss_spike"]]


def inject(losses, at, size=1.0):
    return [x + size if t in at else x for t, x in enumerate(losses)]


@pytest.mark.parametrize("detrend", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_injected_jumps_flagged_and_no_false_positives(detrend, seed):
    losses = curve(seed=seed)
    assert flagged(losses, detrend=detrend) == []  # the smooth noisy curve alone: nothing
    assert flagged(inject(losses, JUMPS), detrend=detrend) == list(JUMPS)


def test_detrend_finds_an_early_spike_the_plain_mean_misses():
    """While the loss falls fast the window mean lags and the trend inflates the std (documented)."""
    losses = curve(steps=600, tau=150.0, seed=0)
    spiky = inject(losses, (150, 400))
    assert flagged(spiky) == [400]  # plain mean: the spike at 150 stays below k
    assert flagged(spiky, detrend=True) == [150, 400]
    assert flagged(losses, detrend=True) == []


def test_one_spike_does_not_mask_the_next():
    losses = curve(steps=300, seed=3)
    spiky = inject(losses, (200, 201, 202))  # three in a row: none enters the statistics
    det = SpikeDetector()
    out = []
    for t, x in enumerate(spiky):
        if t == 200:
            before = det.baseline()
        out.append(det.update(x))
        if t == 202:
            assert det.baseline() == before
    assert [t for t, o in enumerate(out) if o["loss_spike"]] == [200, 201, 202]
    assert all(o["loss_spike_size"] > 4.0 for o in out[200:203])


def test_count_increments_and_fields():
    det = SpikeDetector(window=10, k=4.0, warmup=5)
    seq = [3.0, 3.01, 2.99, 3.0, 3.02, 2.98, 9.0, 3.0, 10.0, 3.01]
    out = [det.update(x) for x in seq]
    assert [o["loss_spike"] for o in out] == [False] * 6 + [True, False, True, False]
    assert [o["loss_spike_count"] for o in out] == [0] * 6 + [1, 1, 2, 2]
    assert out[6]["loss_spike_size"] == pytest.approx((9.0 - np.mean(seq[:6])) / np.std(seq[:6], ddof=1))
    assert all(o["loss_spike_size"] is None for o in out if not o["loss_spike"])
    assert spike_steps([{"step": i + 1, **o} for i, o in enumerate(out)]) == [(7, out[6]["loss_spike_size"]),
                                                                              (9, out[8]["loss_spike_size"])]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
def test_non_finite_loss_is_a_spike_even_in_warmup(bad):
    det = SpikeDetector(warmup=5, window=10)
    det.update(3.0)
    out = det.update(bad)
    assert out == {"loss_spike": True, "loss_spike_size": None, "loss_spike_count": 1}
    assert det.n == 1  # not added to the window
    for x in (3.0, 3.1, 2.9, 3.05):
        det.update(x)
    assert det.update(bad)["loss_spike_count"] == 2
    assert all(math.isfinite(v) for _, v in det._values)


def test_no_finite_spike_before_warmup():
    det = SpikeDetector(window=50, warmup=20)
    out = [det.update(x) for x in [3.0, 3.01] * 9 + [100.0]]  # 18 losses, then a jump at n=18 < 20
    assert not any(o["loss_spike"] for o in out)
    out = [det.update(x) for x in [3.0, 100.0]]  # n = 20 after the first: now flagged
    assert [o["loss_spike"] for o in out] == [False, True]


def test_constant_loss_uses_the_std_floor():
    det = SpikeDetector(window=20, warmup=5, min_std=1e-6)
    for _ in range(10):
        det.update(3.0)
    assert not det.update(3.0 + 1e-7)["loss_spike"]  # 0.1 floor-stds: rounding-level, not a spike
    out = det.update(3.0 + 1e-3)
    assert out["loss_spike"] and out["loss_spike_size"] == pytest.approx(1e3, rel=1e-3)


@pytest.mark.parametrize("detrend", [False, True])
def test_running_sums_match_a_direct_computation(detrend):
    """The O(1) sums (with periodic exact refresh) equal numpy over the window, across many windows."""
    window, losses = 50, curve(steps=400, tau=100.0, seed=4)
    det = SpikeDetector(window=window, warmup=10, k=1e9, detrend=detrend)  # k huge: every loss accepted
    for t, x in enumerate(losses):
        if t >= 10:
            center, std = det.baseline()
            w = np.array(losses[max(0, t - window):t])
            if detrend:
                idx = np.arange(t - len(w), t)
                coef = np.polyfit(idx, w, 2)
                res = w - np.polyval(coef, idx)
                u = (idx - t) / window  # leverage of the new index t (invariant to rescaling u)
                X = np.stack([np.ones_like(u), u, u * u], axis=1)
                x0 = np.array([1.0, 0.0, 0.0])
                leverage = x0 @ np.linalg.solve(X.T @ X, x0)
                want = np.polyval(coef, t), math.sqrt(res @ res / (len(w) - 3) * (1 + leverage))
            else:
                want = w.mean(), w.std(ddof=1)
            assert center == pytest.approx(want[0], abs=1e-9 * want[1] + 1e-12)
            assert std == pytest.approx(want[1], rel=1e-8)
        det.update(x)


@pytest.mark.parametrize("detrend", [False, True])
def test_deterministic_and_state_dict_resumes_identically(detrend):
    losses = inject(curve(steps=500, seed=5), (120, 300, 301), 0.5) + [float("nan")] + curve(steps=50, seed=6)
    full, again = SpikeDetector(detrend=detrend), SpikeDetector(detrend=detrend)
    ref = [full.update(x) for x in losses]
    assert [again.update(x) for x in losses] == ref
    assert sum(o["loss_spike"] for o in ref) >= 4  # the jumps and the NaN
    first = SpikeDetector(detrend=detrend)
    part = [first.update(x) for x in losses[:333]]
    resumed = SpikeDetector()
    resumed.load_state_dict(first.state_dict())
    part += [resumed.update(x) for x in losses[333:]]
    assert part == ref


@pytest.mark.parametrize("kw", [dict(window=1), dict(warmup=1), dict(window=10, warmup=11), dict(k=0),
                                dict(detrend=True, window=4, warmup=4)])
def test_invalid_arguments(kw):
    with pytest.raises(ValueError):
        SpikeDetector(**kw)
