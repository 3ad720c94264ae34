"""Speeds and speed-ups as every output states them: the statistic of the one timing harness
(`core/bench/harness.py`), pure arithmetic on per-round rates that reports, gates and the
operating point read without timing anything.

Statistic. A system's speed is `tokens_per_s`: the MEDIAN over rounds of the round's output tokens
over its seconds (`STATISTIC`; one slow round, another job's burst, moves it little). A speed-up of
A over B is paired by round: the ratio of A's and B's rates in the same round, its median over
rounds the point estimate, and its interval a pair of order statistics of those ratios: the
sign-test (distribution-free) interval for the median ratio. With R rounds, [k-th smallest, k-th
largest] covers the median with probability 1 - 2 P(Binomial(R, 1/2) < k); the widest k reaching
`level` is used, and with fewer than 6 rounds no k reaches 95%, so the interval is the range of the
R ratios at its exact coverage (3 rounds: 75%, 4: 87.5%, 5: 93.75%), which every output states. A
bootstrap over 3-5 rounds can do no better (its resamples lie within the same range) and would
claim a coverage it does not have. The only assumption: rounds are exchangeable, which interleaving
is for.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "STATISTIC",
    "Ratio",
    "TimedRate",
    "geometric_mean_ratios",
    "interval_fields",
    "paired_ratios",
    "ratio_interval",
    "speedup",
    "statistic",
    "tokens_per_s",
]

STATISTIC = "median over interleaved rounds"  # what `tokens_per_s` is, named in every output


@dataclass(frozen=True)
class Ratio:
    """A speed-up paired by round: the median per-round ratio and its sign-test interval."""

    value: float
    low: float
    high: float
    coverage: float  # probability that [low, high] holds the median per-round ratio
    rounds: int


class TimedRate(float):
    """A system's tokens/s as the harness states it: the float is `tokens_per_s` (the median over
    rounds), so code that reads a plain rate keeps working, and the per-round figures it is the
    median of (`tokens_per_s_by_round`, what a paired speed-up needs) and the statistic's name
    (`statistic`) travel with it."""

    tokens_per_s_by_round: list[float]
    statistic: str

    def __new__(cls, by_round: Sequence[float]) -> TimedRate:
        rate = super().__new__(cls, tokens_per_s(by_round))
        rate.tokens_per_s_by_round, rate.statistic = list(by_round), statistic(len(by_round))
        return rate

    def __getnewargs__(self) -> tuple[list[float]]:  # type: ignore[override]
        return (self.tokens_per_s_by_round,)  # copies and pickles rebuild it from its rounds


def statistic(rounds: int, level: float = 0.95) -> str:
    """The statistic and interval, named as every output carries them (`statistic` key), e.g.
    `median of 4 interleaved rounds; speed-up interval: per-round ratios ranked 1 and 4 of 4 (87.5%)`."""
    text = f"median of {rounds} interleaved round{'s' if rounds != 1 else ''}"
    if rounds < 1:
        return text
    k = _order(rounds, level)
    return text + (
        f"; speed-up interval: per-round ratios ranked {k} and {rounds + 1 - k} of {rounds}"
        f" ({_coverage(rounds, k):.1%})"
    )


def tokens_per_s(rates: Sequence[float]) -> float:
    """The harness statistic (`STATISTIC`): the median of the per-round rates (nan for none)."""
    return float(statistics.median(rates)) if rates else math.nan


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Per-round ratios a[r] / b[r] of two systems timed in the same rounds."""
    if len(a) != len(b):
        raise ValueError(f"paired by round: {len(a)} rounds against {len(b)}")
    return [x / y if y > 0 else math.nan for x, y in zip(a, b, strict=True)]


def geometric_mean_ratios(series: Sequence[Sequence[float]]) -> list[float]:
    """Per round, the geometric mean of several paired-ratio series (e.g. one per batch size):
    each series weighs the same whatever its scale, and the result stays paired by round."""
    return [
        math.exp(sum(math.log(max(x, 1e-12)) for x in per) / len(per)) for per in zip(*series, strict=True)
    ]


def _coverage(n: int, k: int) -> float:
    """P(k-th smallest <= median <= k-th largest) of n exchangeable continuous values."""
    below = sum(math.comb(n, i) for i in range(k)) / 2**n  # P(Binomial(n, 1/2) < k)
    return 1.0 - 2.0 * below


def _order(n: int, level: float) -> int:
    """k of the sign-test interval of n values: the widest pair reaching `level`, else 1 (the range)."""
    k = 1
    while k + 1 <= (n + 1) // 2 and _coverage(n, k + 1) >= level:
        k += 1
    return k


def ratio_interval(ratios: Sequence[float], level: float = 0.95) -> Ratio:
    """The median of `ratios` (one per round) and its sign-test interval (module doc).

    The widest pair of order statistics whose coverage reaches `level`; with too few rounds for any
    pair to reach it, the range (k = 1) at its own coverage. nan ratios (a round with no time) are dropped.
    """
    xs = sorted(x for x in ratios if not math.isnan(x))
    n = len(xs)
    if n == 0:
        return Ratio(math.nan, math.nan, math.nan, 0.0, 0)
    k = _order(n, level)
    return Ratio(float(statistics.median(xs)), xs[k - 1], xs[n - k], _coverage(n, k), n)


def speedup(a: Sequence[float] | TimedRate, b: Sequence[float] | TimedRate, level: float = 0.95) -> Ratio:
    """A's speed-up over B from their per-round rates (same rounds; a `TimedRate` gives its own):
    `ratio_interval` of the per-round ratios."""
    rounds = [x.tokens_per_s_by_round if isinstance(x, TimedRate) else x for x in (a, b)]
    return ratio_interval(paired_ratios(*rounds), level)


def interval_fields(name: str, ratio: Ratio | None) -> dict[str, Any]:
    """`{name, name_low, name_high}` of a speed-up (None when it was not timed): the flat keys of
    the JSON reports and MLflow metrics."""
    if ratio is None:
        return {name: None, f"{name}_low": None, f"{name}_high": None}
    return {name: ratio.value, f"{name}_low": ratio.low, f"{name}_high": ratio.high}
