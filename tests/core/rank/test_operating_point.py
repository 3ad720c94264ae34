"""The operating point: the fastest (tau, window) within the R@1 budget of the AR teacher, or a refusal."""

from __future__ import annotations

import pytest

from diffusion_gr2.core.rank.operating_point import (
    OperatingPointError,
    choose_operating_point,
    refused_operating_point,
    resolve_operating_point,
)


def _row(tau: float, window: int | None, recall: float, speed: float, own: float = 0.5) -> dict:
    return {"tau": tau, "window": window, "recall@1": recall, "tokens_per_s": speed, "unforced_rate": own}


TABLE = [
    _row(0.9, None, 0.200, 1000.0),
    _row(0.9, 4, 0.195, 1300.0),
    _row(0.6, None, 0.192, 1500.0),  # exactly at the floor (0.202 - 0.01)
    _row(0.4, 4, 0.150, 2400.0),  # fastest, but far below the budget
    _row(0.6, 4, 0.191, 1900.0),  # just below the floor
]


def test_picks_the_fastest_setting_within_the_budget() -> None:
    point = choose_operating_point(TABLE, reference_recall=0.202, budget=0.01)
    assert (point["tau"], point["window"]) == (0.6, None)
    assert point["chosen"] == TABLE[2] and point["candidates"] == TABLE and point["refused"] is None
    assert (point["budget"], point["reference"], point["split"]) == (0.01, "ar_rl", "valid")
    # a looser budget admits the faster settings; ties in speed go to the higher R@1
    assert choose_operating_point(TABLE, 0.202, 0.06)["tau"] == 0.4
    tied = [_row(0.9, None, 0.18, 900.0), _row(0.6, None, 0.19, 900.0)]
    assert choose_operating_point(tied, 0.19, 0.01)["tau"] == 0.6


def test_an_own_valid_rate_floor_excludes_settings_the_grammar_carries() -> None:
    table = [_row(0.9, None, 0.20, 1000.0, own=0.60), _row(0.4, None, 0.21, 2000.0, own=0.06)]
    assert choose_operating_point(table, 0.20, 0.01)["tau"] == 0.4  # the rule alone
    point = choose_operating_point(table, 0.20, 0.01, min_unforced_rate=0.5)
    assert point["tau"] == 0.9 and point["min_unforced_rate"] == 0.5
    with pytest.raises(OperatingPointError, match="own valid rate >= 0.70"):
        choose_operating_point(table, 0.20, 0.01, min_unforced_rate=0.7)


def test_refuses_when_nothing_meets_the_budget() -> None:
    with pytest.raises(
        OperatingPointError, match=r"no \(tau, window\) reaches R@1 0\.290.*best R@1 was 0\.200 at tau 0\.9"
    ):
        choose_operating_point(TABLE, reference_recall=0.300, budget=0.01)
    with pytest.raises(OperatingPointError, match="no decoding settings"):
        choose_operating_point([], 0.2, 0.01)


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
