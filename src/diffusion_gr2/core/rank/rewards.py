"""The one reward module: ranking reward with the conditional format bonus (GR2;
docs/evaluation.md#metrics-and-the-reward).

R_rank = (pre-rank position of the target - new position) / N, positions 1-based. The format bonus
alpha is paid only when the target moved up, or was already first and stayed first: copying the
input order therefore earns nothing beyond R_rank = 0 unless that order was already optimal (the
reward hack GR2 reports). An invalid output earns -1, below every valid ranking (R_rank >= -(N-1)/N).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

__all__ = ["INVALID_REWARD", "ranking_reward"]

INVALID_REWARD = -1.0


def _is_permutation(ranking: Sequence[Hashable], prerank: Sequence[Hashable]) -> bool:
    """True when ``ranking`` holds exactly the candidates of ``prerank``, each once."""
    return len(ranking) == len(prerank) and Counter(ranking) == Counter(prerank)


def ranking_reward(
    prerank: Sequence[Hashable],
    ranking: Sequence[Hashable] | None,
    target: Hashable,
    valid: bool,
    alpha: float = 0.2,
    invalid_reward: float = INVALID_REWARD,
) -> float:
    """Reward of one rollout.

    ``prerank``: the N candidates in retriever order (must contain ``target``); ``ranking``: the
    model's permutation of them (None when unparseable); ``valid``: the parser's verdict. A ranking
    flagged valid that is not a permutation of the candidates is treated as invalid, so a parser bug
    cannot leak reward. ``invalid_reward`` must stay below every valid ranking's reward.
    """
    prerank, n = list(prerank), len(prerank)
    if target not in prerank:
        raise ValueError(f"target {target!r} is not among the candidates")
    if invalid_reward > -(n - 1) / n:
        raise ValueError(
            f"invalid_reward {invalid_reward} must be <= {-(n - 1) / n:.3f}, the worst valid reward"
        )
    if not valid or ranking is None or not _is_permutation(list(ranking), prerank):
        return invalid_reward
    old = prerank.index(target) + 1
    new = list(ranking).index(target) + 1
    reward = (old - new) / n
    if new < old or old == new == 1:
        reward += alpha
    return reward
