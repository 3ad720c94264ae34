"""The operating point: the fastest (tau, window) whose paired R@1 interval against the AR teacher
has its lower bound within the budget, or a refusal."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from diffusion_gr2.core.evaluate.metrics import paired_bootstrap
from diffusion_gr2.core.rank.operating_point import (
    OperatingPointError,
    choose_operating_point,
    floor_screen,
    meets_accuracy_gates,
    paired_key,
    paired_recall,
    refused_operating_point,
    resolve_operating_point,
)

KEY = paired_key("ar_rl")


def _row(
    tau: float, window: int | None, low: float, speed: float, own: float = 0.5, recall: float = 0.2
) -> dict:
    """A candidate as the inference node hands it over (the paired fields of `paired_recall`)."""
    return {
        "tau": tau,
        "window": window,
        "recall@1": recall,
        "tokens_per_s": speed,
        "unforced_rate": own,
        KEY: low + 0.02,
        f"{KEY}.low": low,
        f"{KEY}.high": low + 0.04,
        f"{KEY}.half_width": 0.02,
        f"{KEY}.n": 1000,
    }


TABLE = [
    _row(0.9, None, -0.005, 1000.0),
    _row(0.9, 4, -0.008, 1300.0),
    _row(0.6, None, -0.010, 1500.0),  # exactly at the bound (-budget)
    _row(0.4, 4, -0.060, 2400.0),  # fastest, but its interval reaches far below the budget
    _row(0.6, 4, -0.011, 1900.0),  # just below the bound
]


def test_picks_the_fastest_setting_whose_lower_bound_is_within_the_budget() -> None:
    point = choose_operating_point(TABLE, reference_recall=0.202, budget=0.01)
    assert (point["tau"], point["window"]) == (0.6, None)
    assert point["chosen"] == TABLE[2] and point["candidates"] == TABLE and point["refused"] is None
    assert (point["budget"], point["reference"], point["split"]) == (0.01, "ar_rl", "valid")
    assert f"{KEY}.low >= -budget" in point["rule"]
    # a looser budget admits the faster settings; ties in speed go to the higher R@1
    assert choose_operating_point(TABLE, 0.202, 0.06)["tau"] == 0.4
    tied = [_row(0.9, None, 0.0, 900.0, recall=0.18), _row(0.6, None, 0.0, 900.0, recall=0.19)]
    assert choose_operating_point(tied, 0.19, 0.01)["tau"] == 0.6


def test_the_point_estimate_alone_admits_nothing() -> None:
    """A candidate better than the reference on average but with a wide interval is refused."""
    wide = _row(0.6, None, -0.05, 2000.0) | {KEY: 0.01, f"{KEY}.high": 0.07, f"{KEY}.half_width": 0.06}
    with pytest.raises(OperatingPointError, match=r"lower bound >= -0\.010.*best lower bound was -0\.050"):
        choose_operating_point([wide], 0.2, 0.01)


def test_an_own_valid_rate_floor_excludes_settings_the_grammar_carries() -> None:
    table = [_row(0.9, None, 0.0, 1000.0, own=0.60), _row(0.4, None, 0.0, 2000.0, own=0.06)]
    assert choose_operating_point(table, 0.20, 0.01)["tau"] == 0.4  # the interval alone
    point = choose_operating_point(table, 0.20, 0.01, min_unforced_rate=0.5)
    assert point["tau"] == 0.9 and point["min_unforced_rate"] == 0.5
    with pytest.raises(OperatingPointError, match="own valid rate >= 0.70"):
        choose_operating_point(table, 0.20, 0.01, min_unforced_rate=0.7)


def _timed(row: dict, batch_1: float | None, batch_16: float = 0.8) -> dict:
    """`row` with the timed speed-up fields `ranked_speed` writes (medians; None: batch 1 not timed).
    Every low end is under 1: the rule reads the median."""
    by_batch = {"16": {"speedup": batch_16, "speedup_low": batch_16 - 0.2, "speedup_high": batch_16 + 0.1}}
    if batch_1 is not None:
        by_batch["1"] = {"speedup": batch_1, "speedup_low": 0.9, "speedup_high": batch_1 + 0.1}
    return row | {"speedup_vs_ar_rl_by_batch": by_batch}


def test_the_accuracy_gates_are_the_budget_and_the_own_valid_floor_and_need_no_timing() -> None:
    assert [meets_accuracy_gates(r, 0.01) for r in TABLE] == [True, True, True, False, False]
    assert meets_accuracy_gates(_row(0.9, None, 0.0, 1.0, own=0.49), 0.01)  # no floor asked
    assert not meets_accuracy_gates(_row(0.9, None, 0.0, 1.0, own=0.49), 0.01, min_unforced_rate=0.5)
    assert meets_accuracy_gates(_row(0.9, None, 0.0, 1.0, own=0.5), 0.01, min_unforced_rate=0.5)
    assert not meets_accuracy_gates(_row(0.9, None, math.nan, 1.0), 1.0)  # nothing shared: never
    assert not meets_accuracy_gates({"tau": 0.9, "window": None}, 1.0)  # unpaired: never


def test_a_speed_floor_refuses_settings_the_reference_outruns_at_its_batch_size() -> None:
    # The fastest by the ranking statistic is slower than ar_rl at batch 1; the slower one is faster
    # than ar_rl there (its batch-16 figure is not the gate's).
    table = [
        _timed(_row(0.6, None, 0.0, 2000.0), batch_1=0.97, batch_16=1.3),
        _timed(_row(0.9, None, 0.0, 1500.0), batch_1=1.10, batch_16=0.70),
    ]
    assert choose_operating_point(table, 0.20, 0.01)["tau"] == 0.6  # no speed floor: the fastest
    point = choose_operating_point(table, 0.20, 0.01, min_speed_ratio=1.0, speed_batch_size=1)
    assert point["tau"] == 0.9 and point["min_speed_ratio"] == 1.0 and point["speed_batch_size"] == 1
    at_16 = choose_operating_point(table, 0.20, 0.01, min_speed_ratio=1.0, speed_batch_size=16)
    assert at_16["tau"] == 0.6  # at batch 16 it is the faster one
    with pytest.raises(OperatingPointError, match=r"speed-up over ar_rl >= 1.50x at batch 16"):
        choose_operating_point(table, 0.20, 0.01, min_speed_ratio=1.5, speed_batch_size=16)
    # Not timed beside the reference at the gate's batch size: it cannot show it is faster.
    untimed = [_timed(_row(0.9, None, 0.0, 1500.0), batch_1=None), _row(0.6, None, 0.0, 2000.0)]
    with pytest.raises(OperatingPointError, match="not timed"):
        choose_operating_point(untimed, 0.20, 0.01, min_speed_ratio=1.0)
    assert choose_operating_point(untimed, 0.20, 0.01)["tau"] == 0.6


def test_the_floor_screen_is_the_wilson_upper_bound_and_spares_only_settings_far_below() -> None:
    # Hand-computed Wilson bounds: 10 own-valid answers of 151 at z 3.09 -> 0.158; 72 of 151 -> 0.600.
    low = floor_screen(10 / 151, 151, 0.5, 3.09)
    assert low["n"] == 151 and low["own_valid_upper"] == pytest.approx(0.1579, abs=5e-4)
    assert not low["passed"]
    near = floor_screen(72 / 151, 151, 0.5, 3.09)  # 0.477 observed: 0.5 is still within reach
    assert near["own_valid_upper"] == pytest.approx(0.6000, abs=5e-4) and near["passed"]
    # The bound falls with n at a fixed rate, and sits above the rate itself.
    bounds = [floor_screen(0.4, n, 0.5, 3.09)["own_valid_upper"] for n in (20, 151, 1286)]
    assert bounds == sorted(bounds, reverse=True) and all(b > 0.4 for b in bounds)
    assert not floor_screen(0.4, 1286, 0.5, 3.09)["passed"] and floor_screen(0.4, 151, 0.5, 3.09)["passed"]
    assert floor_screen(0.0, 2, 0.5, 1.0)["own_valid_upper"] == pytest.approx(1 / 3)
    assert floor_screen(math.nan, 0, 0.5, 3.09)["passed"]  # nothing decoded: nothing refused


def test_refuses_when_nothing_meets_the_budget() -> None:
    with pytest.raises(OperatingPointError, match=r"best lower bound was -0\.005 at tau 0\.9, window None"):
        choose_operating_point(TABLE, reference_recall=0.300, budget=0.001)
    with pytest.raises(OperatingPointError, match="no decoding settings"):
        choose_operating_point([], 0.2, 0.01)
    unpaired = [{k: v for k, v in TABLE[0].items() if not k.startswith(KEY)}]
    with pytest.raises(ValueError, match="paired_recall"):
        choose_operating_point(unpaired, 0.2, 0.01)
    never = [_row(0.9, None, math.nan, 1000.0)]  # no shared request: NaN bounds never qualify
    with pytest.raises(OperatingPointError, match="best lower bound was"):
        choose_operating_point(never, 0.2, 1.0)


def _rankings(hits: list[int], users: list[int], points: list[int]) -> pd.DataFrame:
    """Validation rows whose served ranking has the target first (hit) or second."""
    return pd.DataFrame(
        {
            "split": "valid",
            "user_id": users,
            "point": points,
            "target": 1,
            "prerank": [[1, 2]] * len(hits),
            "ranking": [[1, 2] if h else [2, 1] for h in hits],
            "valid": True,
        }
    )


def test_paired_recall_is_the_paired_bootstrap_over_users_on_the_shared_requests() -> None:
    rng = np.random.default_rng(0)
    users, points = np.repeat(np.arange(60), 3).tolist(), [0, 1, 2] * 60
    a_hits, b_hits = rng.integers(0, 2, 180).tolist(), rng.integers(0, 2, 180).tolist()
    mine = _rankings(a_hits, users, points)
    theirs = _rankings(b_hits, users, points).iloc[::-1]  # another order: paired by request, not row
    extra = _rankings([1], [99], [0])  # a request the reference never answered: left out
    fields = paired_recall(pd.concat([mine, extra]), theirs, "ar_rl", n_boot=200, seed=3)
    expected = paired_bootstrap(a_hits, b_hits, 200, 3, groups=users)
    assert fields[KEY] == pytest.approx(np.mean(a_hits) - np.mean(b_hits))
    assert (fields[f"{KEY}.low"], fields[f"{KEY}.high"]) == pytest.approx((expected.low, expected.high))
    assert fields[f"{KEY}.half_width"] == pytest.approx((expected.high - expected.low) / 2)
    assert fields[f"{KEY}.n"] == 180
    # one user's points resampled together: not the interval of 180 independent requests
    alone = paired_bootstrap(a_hits, b_hits, 200, 3)
    assert (alone.low, alone.high) != pytest.approx((expected.low, expected.high))
    nothing = paired_recall(mine, _rankings([1], [99], [0]), "ar_rl", n_boot=10)
    assert nothing[f"{KEY}.n"] == 0 and math.isnan(nothing[f"{KEY}.low"])


def test_resolve_reads_the_choice_and_refuses_clearly() -> None:
    points = {
        "rl": choose_operating_point(TABLE, 0.202, 0.01),
        "naive": refused_operating_point(TABLE, 0.202, 0.01, "nothing within the budget", "ar_rl"),
    }
    assert resolve_operating_point(points, "rl") == (0.6, None)
    with pytest.raises(OperatingPointError, match="'naive' has no operating point: nothing within"):
        resolve_operating_point(points, "naive")
    with pytest.raises(OperatingPointError, match="no entry for it"):
        resolve_operating_point(points, "opd")
    with pytest.raises(OperatingPointError, match="no entry for it"):
        resolve_operating_point(None, "rl")


@pytest.mark.parametrize(
    ("speed", "admitted"),
    [(1.0, True), (1.0 - 1e-12, True), (1.0 - 1e-6, False)],  # the floor, its float tolerance, below
)
def test_the_speed_floor_admits_a_speed_up_exactly_at_it(speed: float, admitted: bool) -> None:
    table = [_timed(_row(0.9, None, 0.0, 1500.0), batch_1=speed)]
    if admitted:
        assert choose_operating_point(table, 0.20, 0.01, min_speed_ratio=1.0)["tau"] == 0.9
    else:
        with pytest.raises(OperatingPointError, match="speed-up over ar_rl >= 1.00x"):
            choose_operating_point(table, 0.20, 0.01, min_speed_ratio=1.0)


@pytest.mark.parametrize(
    ("low", "own", "admitted"),
    [
        (-0.03, 0.5, True),  # both exactly at their bound
        (-0.03 - 1e-12, 0.5, True),  # the budget's float tolerance
        (-0.03 - 1e-6, 0.5, False),
        (-0.03, 0.5 - 1e-9, False),
    ],
)
def test_the_budget_and_the_own_valid_floor_admit_a_candidate_exactly_at_them(
    low: float, own: float, admitted: bool
) -> None:
    row = _row(0.9, None, low, 1500.0, own=own)
    assert meets_accuracy_gates(row, 0.03, min_unforced_rate=0.5) is admitted
    if admitted:
        assert choose_operating_point([row], 0.20, 0.03, min_unforced_rate=0.5)["tau"] == 0.9
    else:
        with pytest.raises(OperatingPointError):
            choose_operating_point([row], 0.20, 0.03, min_unforced_rate=0.5)
