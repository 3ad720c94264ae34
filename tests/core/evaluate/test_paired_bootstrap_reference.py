"""The paired bootstrap's interval against a slow loop written from its definition: the same draws,
each resample's mean difference summed by hand, the percentiles interpolated by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from diffusion_gr2.core.evaluate.metrics import paired_bootstrap


def _percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between order statistics."""
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (pos - lo) * (sorted_values[hi] - sorted_values[lo])


def loop_interval(
    a: list[float], b: list[float], users: list[int], n_boot: int, seed: int, level: float
) -> tuple[float, float]:
    """Resample users with replacement; each resample's mean of a - b over every request its users hold;
    the central `level` share of those means."""
    order = sorted(set(users))
    held = {u: [i for i, v in enumerate(users) if v == u] for u in order}
    draws = np.random.default_rng(seed).integers(0, len(order), size=(n_boot, len(order)))
    means = []
    for row in draws:
        requests = [i for g in row for i in held[order[g]]]
        means.append(sum(a[i] - b[i] for i in requests) / len(requests))
    means.sort()
    tail = (1.0 - level) / 2.0 * 100.0
    return _percentile(means, tail), _percentile(means, 100.0 - tail)


@pytest.mark.parametrize("level", [0.95, 0.8])
def test_the_interval_is_the_loop_references(level: float) -> None:
    rng = np.random.default_rng(7)
    users = sorted(rng.integers(0, 40, size=150).tolist())  # several requests per user
    a = rng.binomial(1, 0.3, size=150).astype(float).tolist()
    b = rng.binomial(1, 0.25, size=150).astype(float).tolist()
    result = paired_bootstrap(a, b, n_boot=400, seed=3, level=level, groups=users)
    low, high = loop_interval(a, b, users, n_boot=400, seed=3, level=level)
    assert (result.low, result.high) == (pytest.approx(low, abs=1e-12), pytest.approx(high, abs=1e-12))
    assert result.mean_diff == pytest.approx(sum(x - y for x, y in zip(a, b, strict=True)) / 150)
