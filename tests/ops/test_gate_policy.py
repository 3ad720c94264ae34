"""The gate under the serving policy's own bars (conf/base's `policy`): each passes a figure exactly at
it and the lowest its tolerance admits, refuses the next float below, and a side without its own
valid rate is refused by name."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from diffusion_gr2.core.base.speed import Ratio
from diffusion_gr2.core.evaluate.metrics import PairedBootstrap
from diffusion_gr2.core.evaluate.policy import TOLERANCE, Policy
from diffusion_gr2.core.registry import gate
from diffusion_gr2.core.registry.gate import GateConfig, decide
from diffusion_gr2.parameters import load_parameters
from tests.ops.test_gate import side

POLICY = Policy.from_params(load_parameters(conf_source=Path(__file__).parents[2] / "conf")["policy"])
CONFIG = GateConfig(n_boot=50, policy=POLICY)
HITS = [1.0, 0.0] * 10


def gated(monkeypatch: pytest.MonkeyPatch, check: str, value: float) -> dict[str, Any]:
    """A first promotion whose checks all pass by far, but `check`, whose figure is `value`.

    The paired R@1 lower bounds and the speed-up's low end are set where the gate reads them (the
    bootstrap and the harness are pinned elsewhere): the comparison with the bar is what is tested.
    """
    lows = {"prerank": 0.1, "teacher": 0.1}
    if check.startswith("recall@1_vs_"):
        lows[check.removeprefix("recall@1_vs_").removesuffix(".low")] = value
    calls = iter(["prerank", "teacher"])  # the order `decide` compares in

    def bootstrap(a: Any, b: Any, n_boot: int, seed: int, *, level: float, groups: Any) -> PairedBootstrap:
        assert level == 0.95
        low = lows[next(calls)]
        return PairedBootstrap(low + 0.02, low, low + 0.04, 0.0)

    speed = value if check == "speed_ratio_vs_ar_rl.low" else 2.0
    monkeypatch.setattr(gate, "paired_bootstrap", bootstrap)
    monkeypatch.setattr(gate, "speedup", lambda a, b, level: Ratio(speed + 0.1, speed, speed + 0.2, 0.97, 6))
    own = value if check == "unforced_rate" else 0.9
    return decide(side(HITS, own=own), None, side(HITS, speed=100.0), side(HITS), CONFIG, list(range(20)))


BARS = {  # each check and its bar under conf/base's policy (the negations are exact)
    "unforced_rate": POLICY.min_unforced_rate,
    "speed_ratio_vs_ar_rl.low": POLICY.min_speed_ratio,
    "recall@1_vs_prerank.low": -POLICY.prerank_margin,
    "recall@1_vs_teacher.low": -POLICY.gate_margin,
}


@pytest.mark.parametrize(("check", "bar"), BARS.items())
def test_each_bar_passes_exactly_at_it_and_refuses_below(
    monkeypatch: pytest.MonkeyPatch, check: str, bar: float
) -> None:
    assert (POLICY.min_unforced_rate, POLICY.min_speed_ratio) == (0.5, 1.0)
    assert (POLICY.prerank_margin, POLICY.gate_margin) == (0.05, 0.05)
    for value in (bar, bar - TOLERANCE):  # `>=`: at the bar, and the lowest the tolerance admits
        report = gated(monkeypatch, check, value)
        assert report["decision"] == "promote", (value, report["reasons"])
    report = gated(monkeypatch, check, float(np.nextafter(bar - TOLERANCE, -math.inf)))
    assert report["decision"] == "refuse" and report["decided_by"] == [check]
    assert report["thresholds"] == {
        "margin": 0.05,
        "prerank_margin": 0.05,
        "min_unforced_rate": 0.5,
        "min_speed_ratio": 1.0,
        "level": 0.95,
    }


def test_a_side_without_its_own_valid_rate_is_refused_naming_it() -> None:
    """No default that passes: the figure missing is the check failed."""
    blind = {k: v for k, v in side(HITS).items() if k != "unforced_rate"}
    report = decide(blind, None, side(HITS, speed=100.0), side(HITS), GateConfig(n_boot=50, policy=POLICY))
    assert report["decision"] == "refuse" and "unforced_rate" in report["decided_by"]
    assert "no unforced_rate figure" in report["reasons"] and report["numbers"]["unforced_rate"] is None


def test_the_pre_rank_and_the_champion_are_held_to_their_own_margins(monkeypatch: pytest.MonkeyPatch) -> None:
    """`prerank_margin` against the pre-rank, `gate_margin` against the champion or teacher: the same
    lower bound (-0.05) fails the one bar and clears the other."""
    lows = iter([-0.05, -0.05])
    monkeypatch.setattr(
        gate,
        "paired_bootstrap",
        lambda *args, level, groups: PairedBootstrap(0.0, (low := next(lows)), low + 0.1, 0.5),
    )
    config = GateConfig(n_boot=50, policy=Policy(prerank_margin=0.02, gate_margin=0.10))
    report = decide(side(HITS), None, side(HITS, speed=100.0), side(HITS), config, list(range(20)))
    assert report["decided_by"] == ["recall@1_vs_prerank.low"]
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["recall@1_vs_prerank.low"]["threshold"] == -0.02
    assert (
        checks["recall@1_vs_teacher.low"]["threshold"] == -0.10
        and checks["recall@1_vs_teacher.low"]["passed"]
    )
    assert (report["thresholds"]["prerank_margin"], report["thresholds"]["margin"]) == (0.02, 0.10)
