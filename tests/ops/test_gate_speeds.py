"""The gate times its rankers with the one harness: median over interleaved rounds, paired intervals."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pandas as pd
import pytest

from diffusion_gr2.core.base.speed import TimedRate, speedup, statistic
from diffusion_gr2.core.registry.gate import GateConfig, speeds


class FakeRanker:
    """Answers 10 output tokens per request; each `rank` call lasts the next of the shared `durations`."""

    def __init__(self, name: str, clock: SimpleNamespace, durations: Iterator[float], log: list) -> None:
        self.name, self.clock, self.durations, self.log = name, clock, durations, log
        self.limits = SimpleNamespace(max_requests=100)

    def parse(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return records

    def rank(
        self, parsed: list[dict[str, Any]], batch_size: int | None = None, **_: Any
    ) -> list[dict[str, Any]]:
        self.log.append((self.name, len(parsed), batch_size))
        self.clock.now += next(self.durations)
        return [{"output_tokens": 10, "nfe": 1} for _ in parsed]


def test_speeds_are_medians_of_interleaved_rounds_with_their_rounds() -> None:
    clock, log = SimpleNamespace(now=0.0), []
    # in call order: the warm-ups, then per round the challenger's 2 calls and the teacher's 2; the
    # challenger's calls take 1 s but round 2 is disturbed (4 s), the teacher's always take 2 s
    durations = iter([1.0, 2.0] + [1.0, 1.0, 2.0, 2.0] + [4.0, 4.0, 2.0, 2.0] + [1.0, 1.0, 2.0, 2.0])
    rankers = {name: FakeRanker(name, clock, durations, log) for name in ("challenger", "teacher")}
    requests = pd.DataFrame({"request_id": ["a", "b", "c", "d"]})
    config = GateConfig(speed_batch_size=2, speed_requests=4, speed_rounds=3)
    rates = speeds(rankers, requests, config, clock=lambda: clock.now)  # type: ignore[arg-type]
    assert [n for n, _, _ in log] == ["challenger", "teacher"] + (["challenger"] * 2 + ["teacher"] * 2) * 3
    assert all(rows == 2 and b == 2 for _, rows, b in log)  # full batches of speed_batch_size
    c, t = rates["challenger"], rates["teacher"]
    assert isinstance(c, TimedRate) and c.tokens_per_s_by_round == [20.0, 5.0, 20.0]  # 40 tokens a round
    assert float(c) == 20.0 and float(t) == 10.0  # the median: the disturbed round does not count
    assert c.statistic == t.statistic == statistic(3)
    ratio = speedup(c, t)  # what decide() can compare: paired by round, with its interval
    assert (ratio.value, ratio.low, ratio.high, ratio.coverage) == (2.0, 0.5, 2.0, 0.75)
    assert json.loads(json.dumps({"rate": c})) == {"rate": 20.0}  # reports still see a number
    twin = copy.deepcopy(c)
    assert twin == c and twin.tokens_per_s_by_round == c.tokens_per_s_by_round
    assert c / t == pytest.approx(2.0)  # and arithmetic on it is a float's
