"""The operating point: the fastest (tau, window) that clears the serving policy's bars (paired R@1
lower bounds against the AR teacher and the pre-rank, the own-valid floor, the speed floor), or a
refusal naming why."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from diffusion_gr2.core.evaluate.metrics import paired_bootstrap
from diffusion_gr2.core.evaluate.policy import TOLERANCE, Policy
from diffusion_gr2.core.rank.operating_point import (
    PRERANK,
    OperatingPointError,
    accuracy_refusals,
    choose_operating_point,
    floor_screen,
    meets_accuracy_gates,
    paired_key,
    paired_recall,
    refused_operating_point,
    resolve_operating_point,
)

KEY = paired_key("ar_rl")
PRE = paired_key(PRERANK)
# Only the R@1 margin against ar_rl binds unless a test sets another bar (every figure is still read:
# a missing one refuses).
LOOSE = Policy(min_unforced_rate=0.0, min_speed_ratio=0.0, choice_margin=0.01, prerank_margin=1.0)


def bars(**changes: float) -> Policy:
    return replace(LOOSE, **changes)


def _row(
    tau: float, window: int | None, low: float, speed: float, own: float = 0.5, recall: float = 0.2
) -> dict:
    """A candidate as the inference node hands it over (the paired fields of `paired_recall`
    against ar_rl and the pre-rank, and a batch-1 speed-up timed beside ar_rl)."""
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
        PRE: 0.01,
        f"{PRE}.low": -0.01,
        f"{PRE}.high": 0.03,
        f"{PRE}.half_width": 0.02,
        f"{PRE}.n": 1000,
        "speedup_vs_ar_rl_by_batch": {"1": {"speedup": 1.2, "speedup_low": 0.9, "speedup_high": 1.3}},
    }


TABLE = [
    _row(0.9, None, -0.005, 1000.0),
    _row(0.9, 4, -0.008, 1300.0),
    _row(0.6, None, -0.010, 1500.0),  # exactly at the bound (-budget)
    _row(0.4, 4, -0.060, 2400.0),  # fastest, but its interval reaches far below the budget
    _row(0.6, 4, -0.011, 1900.0),  # just below the bound
]


def test_picks_the_fastest_setting_whose_lower_bound_is_within_the_budget() -> None:
    point = choose_operating_point(TABLE, 0.202, LOOSE)
    assert (point["tau"], point["window"]) == (0.6, None)
    assert point["chosen"] == TABLE[2] and point["candidates"] == TABLE and point["refused"] is None
    assert (point["budget"], point["reference"], point["split"]) == (0.01, "ar_rl", "valid")
    assert (point["prerank_margin"], point["level"]) == (1.0, 0.95)
    assert f"{KEY}.low >= -budget" in point["rule"] and f"{PRE}.low >= -prerank_margin" in point["rule"]
    # a looser budget admits the faster settings; ties in speed go to the higher R@1
    assert choose_operating_point(TABLE, 0.202, bars(choice_margin=0.06))["tau"] == 0.4
    tied = [_row(0.9, None, 0.0, 900.0, recall=0.18), _row(0.6, None, 0.0, 900.0, recall=0.19)]
    assert choose_operating_point(tied, 0.19, LOOSE)["tau"] == 0.6


def test_the_point_estimate_alone_admits_nothing() -> None:
    """A candidate better than the reference on average but with a wide interval is refused."""
    wide = _row(0.6, None, -0.05, 2000.0) | {KEY: 0.01, f"{KEY}.high": 0.07, f"{KEY}.half_width": 0.06}
    with pytest.raises(OperatingPointError, match=r"lower bound >= -0\.010.*best lower bound was -0\.050"):
        choose_operating_point([wide], 0.2, LOOSE)


def test_an_own_valid_rate_floor_excludes_settings_the_grammar_carries() -> None:
    table = [_row(0.9, None, 0.0, 1000.0, own=0.60), _row(0.4, None, 0.0, 2000.0, own=0.06)]
    assert choose_operating_point(table, 0.20, LOOSE)["tau"] == 0.4  # the interval alone
    point = choose_operating_point(table, 0.20, bars(min_unforced_rate=0.5))
    assert point["tau"] == 0.9 and point["min_unforced_rate"] == 0.5
    with pytest.raises(OperatingPointError, match="own valid rate >= 0.70"):
        choose_operating_point(table, 0.20, bars(min_unforced_rate=0.7))


def _timed(row: dict, batch_1: float | None, batch_16: float = 0.8) -> dict:
    """`row` with the timed speed-up fields `ranked_speed` writes (medians; None: batch 1 not timed).
    Every low end is under 1: the rule reads the median."""
    by_batch = {"16": {"speedup": batch_16, "speedup_low": batch_16 - 0.2, "speedup_high": batch_16 + 0.1}}
    if batch_1 is not None:
        by_batch["1"] = {"speedup": batch_1, "speedup_low": 0.9, "speedup_high": batch_1 + 0.1}
    return row | {"speedup_vs_ar_rl_by_batch": by_batch}


def test_the_accuracy_gates_are_the_margins_and_the_own_valid_floor_and_need_no_timing() -> None:
    assert [meets_accuracy_gates(r, LOOSE) for r in TABLE] == [True, True, True, False, False]
    assert meets_accuracy_gates(_row(0.9, None, 0.0, 1.0, own=0.49), LOOSE)  # a floor of 0
    assert not meets_accuracy_gates(_row(0.9, None, 0.0, 1.0, own=0.49), bars(min_unforced_rate=0.5))
    assert meets_accuracy_gates(_row(0.9, None, 0.0, 1.0, own=0.5), bars(min_unforced_rate=0.5))
    loose = bars(choice_margin=1.0)
    assert not meets_accuracy_gates(_row(0.9, None, math.nan, 1.0), loose)  # nothing shared: never
    assert not meets_accuracy_gates({"tau": 0.9, "window": None}, loose)  # unpaired: never
    no_speed = {k: v for k, v in _row(0.9, None, 0.0, 1.0).items() if not k.startswith("speedup")}
    assert meets_accuracy_gates(no_speed, LOOSE)  # timing is not an accuracy bar


def test_a_speed_floor_refuses_settings_the_reference_outruns_at_its_batch_size() -> None:
    # The fastest by the ranking statistic is slower than ar_rl at batch 1; the slower one is faster
    # than ar_rl there (its batch-16 figure is not the gate's).
    table = [
        _timed(_row(0.6, None, 0.0, 2000.0), batch_1=0.97, batch_16=1.3),
        _timed(_row(0.9, None, 0.0, 1500.0), batch_1=1.10, batch_16=0.70),
    ]
    assert choose_operating_point(table, 0.20, LOOSE)["tau"] == 0.6  # a floor of 0: the fastest
    faster = bars(min_speed_ratio=1.0)
    point = choose_operating_point(table, 0.20, faster, speed_batch_size=1)
    assert point["tau"] == 0.9 and point["min_speed_ratio"] == 1.0 and point["speed_batch_size"] == 1
    at_16 = choose_operating_point(table, 0.20, faster, speed_batch_size=16)
    assert at_16["tau"] == 0.6  # at batch 16 it is the faster one
    with pytest.raises(OperatingPointError, match=r"speed-up over ar_rl >= 1.50x at batch 16"):
        choose_operating_point(table, 0.20, bars(min_speed_ratio=1.5), speed_batch_size=16)
    # Not timed beside the reference at the gate's batch size: it cannot show it is faster, even
    # against a floor of 0 (a missing figure never passes).
    untimed = [_timed(_row(0.9, None, 0.0, 1500.0), batch_1=None)]
    with pytest.raises(OperatingPointError, match="not timed"):
        choose_operating_point(untimed, 0.20, faster)
    with pytest.raises(OperatingPointError, match="speed-up over ar_rl at batch 1 not timed"):
        choose_operating_point(untimed, 0.20, LOOSE)


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
        choose_operating_point(TABLE, 0.300, bars(choice_margin=0.001))
    with pytest.raises(OperatingPointError, match="no decoding settings"):
        choose_operating_point([], 0.2, LOOSE)
    unpaired = [{k: v for k, v in TABLE[0].items() if not k.startswith(KEY)}]
    with pytest.raises(OperatingPointError, match=rf"no {KEY}\.low \(paired with ar_rl: paired_recall\)"):
        choose_operating_point(unpaired, 0.2, LOOSE)
    never = [_row(0.9, None, math.nan, 1000.0)]  # no shared request: NaN bounds never qualify
    with pytest.raises(OperatingPointError, match="best lower bound was"):
        choose_operating_point(never, 0.2, bars(choice_margin=1.0))


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
    fields = paired_recall(pd.concat([mine, extra]), theirs, "ar_rl", n_boot=200, seed=3, level=0.95)
    expected = paired_bootstrap(a_hits, b_hits, 200, 3, level=0.95, groups=users)
    assert fields[KEY] == pytest.approx(np.mean(a_hits) - np.mean(b_hits))
    assert (fields[f"{KEY}.low"], fields[f"{KEY}.high"]) == pytest.approx((expected.low, expected.high))
    assert fields[f"{KEY}.half_width"] == pytest.approx((expected.high - expected.low) / 2)
    assert fields[f"{KEY}.n"] == 180
    # one user's points resampled together: not the interval of 180 independent requests
    alone = paired_bootstrap(a_hits, b_hits, 200, 3, level=0.95)
    assert (alone.low, alone.high) != pytest.approx((expected.low, expected.high))
    nothing = paired_recall(mine, _rankings([1], [99], [0]), "ar_rl", n_boot=10, level=0.95)
    assert nothing[f"{KEY}.n"] == 0 and math.isnan(nothing[f"{KEY}.low"])


def test_resolve_reads_the_choice_and_refuses_clearly() -> None:
    points = {
        "rl": choose_operating_point(TABLE, 0.202, LOOSE),
        "naive": refused_operating_point(TABLE, 0.202, LOOSE, "nothing within the budget", "ar_rl"),
    }
    assert resolve_operating_point(points, "rl") == (0.6, None)
    with pytest.raises(OperatingPointError, match="'naive' has no operating point: nothing within"):
        resolve_operating_point(points, "naive")
    with pytest.raises(OperatingPointError, match="no entry for it"):
        resolve_operating_point(points, "opd")
    with pytest.raises(OperatingPointError, match="no entry for it"):
        resolve_operating_point(None, "rl")


# --- each bar of the serving policy (conf/base's values: `Policy()`) at its bound ------------------


def _at(figure: str, value: float) -> dict:
    """A candidate that clears every bar of `Policy()` by far, with `figure` set to `value`."""
    row = _row(0.9, None, 0.0, 1500.0, own=0.9) | {f"{PRE}.low": 0.0}
    row["speedup_vs_ar_rl_by_batch"]["1"]["speedup"] = 2.0
    if figure == "speedup":
        row["speedup_vs_ar_rl_by_batch"]["1"]["speedup"] = value
    else:
        row[figure] = value
    return row


BARS = [  # (figure, its bar under Policy(): every one exact in binary or the policy's own negation)
    (f"{KEY}.low", -Policy().choice_margin),
    (f"{PRE}.low", -Policy().prerank_margin),
    ("unforced_rate", Policy().min_unforced_rate),
    ("speedup", Policy().min_speed_ratio),
]


@pytest.mark.parametrize(("figure", "bar"), BARS)
def test_every_bar_admits_a_figure_exactly_at_it_and_refuses_one_below(figure: str, bar: float) -> None:
    """`>=`, not `>`: the figure at the bar is served, and so is the lowest the tolerance admits
    (`bar - TOLERANCE`, the policy's own arithmetic); the next float below is refused."""
    assert (Policy().choice_margin, Policy().prerank_margin) == (0.03, 0.05)
    assert (Policy().min_unforced_rate, Policy().min_speed_ratio) == (0.5, 1.0)
    for value in (bar, bar - TOLERANCE):
        assert choose_operating_point([_at(figure, value)], 0.2, Policy())["tau"] == 0.9, value
    below = np.nextafter(bar - TOLERANCE, -math.inf)
    with pytest.raises(OperatingPointError, match="refused: tau 0.9, window None: "):
        choose_operating_point([_at(figure, below)], 0.2, Policy())


def test_a_setting_that_loses_to_the_pre_rank_is_refused_however_close_to_ar_rl() -> None:
    """Non-inferior to ar_rl (its bound at 0) but shown to lose more than the margin to the
    retriever's own order: not served; the reason names the pre-rank's figure."""
    worse = _at(f"{PRE}.low", -0.08)
    assert accuracy_refusals(worse, Policy()) == [f"{PRE}.low -0.080 < -0.050"]
    with pytest.raises(
        OperatingPointError, match=rf"one against prerank with a lower bound >= -0\.050.*{PRE}\.low"
    ):
        choose_operating_point([worse], 0.2, Policy())
    fine = _at(f"{PRE}.low", -0.04)
    assert choose_operating_point([worse, fine], 0.2, Policy())["chosen"] == fine
    unpaired = {k: v for k, v in fine.items() if not k.startswith(PRE)}
    assert accuracy_refusals(unpaired, Policy()) == [f"no {PRE}.low (paired with prerank: paired_recall)"]


def test_a_candidate_without_an_own_valid_figure_is_refused_naming_it() -> None:
    """No `.get(..., 1.0)`: a missing own valid rate refuses even under a floor of 0."""
    blind = {k: v for k, v in _row(0.9, None, 0.0, 1500.0).items() if k != "unforced_rate"}
    reason = "no unforced_rate (the own valid rate of the free pass)"
    assert accuracy_refusals(blind, LOOSE) == [reason]
    assert not meets_accuracy_gates(blind, LOOSE)
    with pytest.raises(OperatingPointError, match=re.escape(f"tau 0.9, window None: {reason}")):
        choose_operating_point([blind], 0.2, LOOSE)
    assert choose_operating_point([blind, TABLE[0]], 0.2, LOOSE)["chosen"] == TABLE[0]  # the other serves
