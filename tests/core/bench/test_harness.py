"""The timing harness on fake systems and a fake clock: warm-up, interleaving, full batches, statistics."""

from __future__ import annotations

import math
import statistics

import pytest

from diffusion_gr2.core.base.speed import (
    geometric_mean_ratios,
    interval_fields,
    paired_ratios,
    ratio_interval,
    speedup,
    statistic,
    tokens_per_s,
)
from diffusion_gr2.core.bench.harness import (
    Call,
    TimedSystem,
    calls_per_round,
    cycled_batches,
    round_rates,
    time_rounds,
)


class FakeClock:
    """Time moves only when a fake system works: `advance(s)` adds s seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def fake_system(
    clock: FakeClock, log: list, name: str, batch_size: int, seconds: list[float], tokens: int = 10
) -> TimedSystem[int]:
    """Writes `tokens` per row; its calls last `seconds[i]` (then the last one again)."""
    made = []

    def run(batch: list[int]) -> list[tuple[int, int]]:
        log.append((name, list(batch)))
        clock.advance(seconds[min(len(made), len(seconds) - 1)])
        made.append(1)
        return [(tokens, 2) for _ in batch]

    return TimedSystem(run, batch_size)


def test_warmup_then_interleaved_rounds_of_full_batches() -> None:
    clock, log = FakeClock(), []
    systems = {
        "a": fake_system(clock, log, "a", 1, [1.0]),
        "b": fake_system(clock, log, "b", 2, [1.0]),
    }
    out = time_rounds(systems, [0, 1, 2], rounds=2, warmup=1, min_calls=4, clock=clock)
    # warm-ups first (untimed, each on its first batch), then per round a's calls, then b's
    assert log[:2] == [("a", [0]), ("b", [0, 1])]
    names = [n for n, _ in log[2:]]
    assert names == ["a", "a", "b", "b"] * 2  # ceil(max(4, 3) / 2) = 2 calls a round at batch 1 and 2
    assert all(len(batch) == systems[n].batch_size for n, batch in log)  # always full batches
    # the rounds go on cycling the requests where the last one stopped
    assert [b for n, b in log[2:] if n == "b"] == [[0, 1], [2, 0], [1, 2], [0, 1]]
    assert [len(r) for r in out["a"]] == [2, 2] and [len(r) for r in out["b"]] == [2, 2]
    assert out["b"][0][0] == Call(1.0, [10, 10], [2, 2])


def test_every_request_is_decoded_and_min_calls_are_met() -> None:
    assert calls_per_round(1, 20, rounds=4, min_calls=20) == 5
    assert calls_per_round(16, 20, rounds=3, min_calls=1) == 1  # ceil(20 / 16) = 2 in all: 1 a round
    assert calls_per_round(1, 16, rounds=3, min_calls=1) == 6  # 16 prompts once each over 3 rounds
    prompts = [[1], [2], [3]]  # batches are always full: the prompts are cycled
    assert cycled_batches(prompts, 1, 3) == [[[1]], [[2]], [[3]]]
    assert cycled_batches(prompts, 2, 2) == [[[1], [2]], [[3], [1]]]
    assert cycled_batches(prompts, 16, 1) == [[[1], [2], [3]] * 5 + [[1]]]
    assert cycled_batches([1, 2, 3], 2, 2, start=4) == [[2, 3], [1, 2]]
    with pytest.raises(ValueError):
        cycled_batches([], 4, 1)
    with pytest.raises(ValueError):
        time_rounds({}, [1], rounds=0)


def test_the_statistic_is_the_median_of_the_round_rates() -> None:
    clock, log = FakeClock(), []
    # 3 rounds of one 1-row call each; round 2 is disturbed (another job): 5 s instead of 1 s
    slow = fake_system(clock, log, "x", 1, [1.0, 1.0, 5.0, 1.0])  # warm-up, then rounds
    rounds = time_rounds({"x": slow}, [0], rounds=3, warmup=1, clock=clock)["x"]
    rates = round_rates(rounds)
    assert rates == [10.0, 2.0, 10.0]
    assert tokens_per_s(rates) == 10.0  # the disturbed round moves the median not at all
    assert sum(sum(c.output_tokens) for r in rounds for c in r) / 7.0 < 5  # total / total would: 30 / 7 s
    assert math.isnan(tokens_per_s([]))
    assert (
        statistic(4)
        == "median of 4 interleaved rounds; speed-up interval: per-round ratios ranked 1 and 4 of 4 (87.5%)"
    )
    assert statistic(9).endswith("ranked 2 and 8 of 9 (96.1%)")


def test_speedups_are_paired_by_round_and_cancel_a_drift_both_share() -> None:
    # the machine slows down round after round; A is 2x B in every round
    b = [100.0, 80.0, 60.0, 40.0]
    a = [2 * x for x in b]
    ratio = speedup(a, b)
    assert (ratio.value, ratio.low, ratio.high) == (2.0, 2.0, 2.0) and ratio.rounds == 4
    # unpaired, A's slowest round against B's fastest would read 0.8x, its fastest against B's slowest 10x
    assert paired_ratios([1.0, 3.0], [2.0, 2.0]) == [0.5, 1.5]
    with pytest.raises(ValueError):
        paired_ratios([1.0], [1.0, 2.0])


@pytest.mark.parametrize(
    ("n", "k", "coverage"),
    [(1, 1, 0.0), (3, 1, 0.75), (4, 1, 0.875), (5, 1, 0.9375), (6, 1, 0.96875), (9, 2, 1 - 20 / 512)],
)
def test_ratio_interval_is_the_sign_test_interval_of_the_median(n: int, k: int, coverage: float) -> None:
    ratios = [1.0 + 0.1 * i for i in (3, 0, 4, 1, 5, 2, 8, 6, 7)[:n]]  # shuffled: order must not matter
    got = ratio_interval(ratios)
    xs = sorted(ratios)
    assert got.value == pytest.approx(statistics.median(xs))
    assert (got.low, got.high) == (xs[k - 1], xs[n - k])
    assert got.coverage == pytest.approx(coverage) and got.rounds == n
    # the coverage is the exact probability of the order statistics bracketing the median
    brute = sum(math.comb(n, i) for i in range(k, n - k + 1)) / 2**n
    assert got.coverage == pytest.approx(brute)


def test_empty_rounds_and_missing_references() -> None:
    empty = ratio_interval([math.nan])
    assert math.isnan(empty.value) and empty.rounds == 0
    assert interval_fields("speedup_vs_ar", None) == {
        "speedup_vs_ar": None,
        "speedup_vs_ar_low": None,
        "speedup_vs_ar_high": None,
    }
    fields = interval_fields("s", ratio_interval([1.0, 2.0, 3.0]))
    assert fields == {"s": 2.0, "s_low": 1.0, "s_high": 3.0}
    (no_time,) = round_rates([[Call(0.0, [3], [1])]])
    assert math.isnan(no_time)  # a round that took no time has no rate


def test_geometric_mean_of_ratio_series_stays_paired_by_round() -> None:
    at1, at16 = [2.0, 4.0], [0.5, 1.0]
    assert geometric_mean_ratios([at1, at16]) == pytest.approx([1.0, 2.0])
