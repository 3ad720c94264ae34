"""Ranking reward with the conditional format bonus, on hand-checked cases (N = 5, alpha = 0.2)."""

from __future__ import annotations

import pytest

from diffusion_gr2.core.rank.rewards import ranking_reward

PRERANK = ["a", "b", "c", "d", "e"]


@pytest.mark.parametrize(
    ("ranking", "target", "expected"),
    [
        (["c", "a", "b", "d", "e"], "c", (3 - 1) / 5 + 0.2),  # promotion: R_rank + bonus
        (["a", "c", "b", "d", "e"], "c", (3 - 2) / 5 + 0.2),  # small promotion still earns the bonus
        (["a", "c", "d", "e", "b"], "b", (2 - 5) / 5),  # demotion: no bonus
        (PRERANK, "c", 0.0),  # copy of the input order: no bonus (the GR2 reward hack)
        (PRERANK, "a", 0.2),  # already first and kept first: bonus
        (["a", "e", "d", "c", "b"], "a", 0.2),  # first kept first, the rest reshuffled
        (["b", "a", "c", "d", "e"], "a", -0.2),  # first demoted to second: no bonus
    ],
)
def test_hand_checked_rewards(ranking: list[str], target: str, expected: float) -> None:
    assert ranking_reward(PRERANK, ranking, target, valid=True) == pytest.approx(expected)


def test_alpha_is_a_parameter() -> None:
    assert ranking_reward(PRERANK, ["c", "a", "b", "d", "e"], "c", True, alpha=0.0) == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("ranking", "valid"),
    [
        (["c", "a", "b", "d", "e"], False),  # parser said invalid
        (None, False),  # nothing parseable
        (None, True),
        (["c", "c", "b", "d", "e"], True),  # flagged valid but a duplicate: still invalid
        (["c", "a", "b", "d"], True),  # an item dropped
        (["c", "a", "b", "d", "z"], True),  # a foreign item
    ],
)
def test_invalid_outputs_get_minus_one(ranking: list[str] | None, valid: bool) -> None:
    assert ranking_reward(PRERANK, ranking, "c", valid) == -1.0


def test_invalid_is_below_every_valid_ranking() -> None:
    worst_valid = ranking_reward(PRERANK, ["b", "c", "d", "e", "a"], "a", True)
    assert worst_valid == pytest.approx(-0.8) and worst_valid > -1.0


def test_the_invalid_reward_is_a_parameter_that_must_stay_below_every_valid_ranking() -> None:
    assert ranking_reward(PRERANK, None, "c", False, invalid_reward=-2.0) == -2.0
    assert ranking_reward(PRERANK, PRERANK, "c", True, invalid_reward=-2.0) == 0.0  # valid ones unchanged
    with pytest.raises(ValueError, match="worst valid reward"):
        ranking_reward(PRERANK, None, "c", False, invalid_reward=-0.5)


def test_target_must_be_a_candidate() -> None:
    with pytest.raises(ValueError, match="not among"):
        ranking_reward(PRERANK, PRERANK, "z", True)


def test_integer_ids() -> None:
    assert ranking_reward([7, 3, 9], [9, 7, 3], 9, True) == pytest.approx(2 / 3 + 0.2)
