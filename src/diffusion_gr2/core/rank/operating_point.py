"""The operating point of a block-diffusion re-ranker: the (tau, window) it is served at
(docs/evaluation.md#how-the-operating-point-is-chosen).

Chosen on the *validation* split, never on test: among the decoding settings tried there, the
fastest whose paired R@1 difference against the AR teacher on the same requests has a 95% interval
whose lower bound is at least `-budget` (`paired_recall`: users resampled, as in the evaluation).
A point estimate within the budget on ~190 requests, where that interval is +-5-6 points, admits
settings by chance; the lower bound admits only those shown to lose at most `budget`. Two more
gates, each optional: the model's own valid rate (`min_unforced_rate`: answers the grammar did not
write) and the timed speed-up over the reference (`min_speed_ratio`: a diffusion setting the AR model
outruns buys nothing for its risk). The choice
(with every figure it was made from) is written to `operating_point.json`, which `inference`,
`benchmark` and serving read when their `tau` is `auto`. When no setting meets the budget the
system has no operating point: the file says why, and asking for `auto` is a clear error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from diffusion_gr2.core.evaluate.metrics import paired_bootstrap, request_key, user_values

__all__ = [
    "OperatingPointError",
    "choose_operating_point",
    "floor_screen",
    "meets_accuracy_gates",
    "paired_key",
    "paired_recall",
    "refused_operating_point",
    "resolve_operating_point",
    "speedup_key",
    "timed_speed_ratio",
]


class OperatingPointError(ValueError):
    """No decoding setting meets the accuracy budget (or none was chosen for the system)."""


def paired_key(reference: str = "ar_rl") -> str:
    """Name of a candidate's paired R@1 difference against `reference` (`recall@1_vs_ar_rl`); its
    interval, half-width and request count are the `.low`, `.high`, `.half_width`, `.n` keys."""
    return f"recall@1_vs_{reference}"


def speedup_key(reference: str = "ar_rl") -> str:
    """Name of a candidate's timed speed-up over `reference` (`speedup_vs_ar_rl`, `ranked_speed`);
    `_low` and `_high` are its interval over the timing rounds, `_by_batch` the same per batch size."""
    return f"speedup_vs_{reference}"


def timed_speed_ratio(candidate: Mapping[str, Any], reference: str, batch_size: int) -> float | None:
    """`candidate`'s timed speed-up over `reference` at `batch_size`, the median of its per-round
    ratios (None: not timed there)."""
    by_batch = candidate.get(f"{speedup_key(reference)}_by_batch") or {}
    value = (by_batch.get(str(batch_size)) or {}).get("speedup")
    return None if value is None or math.isnan(value) else float(value)


def _rule(reference: str) -> str:
    """The admission rule in words, written beside every choice so the file reads on its own."""
    return (
        f"admitted: {paired_key(reference)}.low >= -budget (95% paired bootstrap over users), "
        f"unforced_rate >= min_unforced_rate and {speedup_key(reference)} at speed_batch_size (median "
        "over the timing rounds) >= min_speed_ratio; "
        "served: the fastest admitted (tokens_per_s)"
    )


def paired_recall(
    rows: pd.DataFrame,
    reference_rows: pd.DataFrame,
    reference: str = "ar_rl",
    n_boot: int = 1000,
    seed: int = 0,
) -> dict[str, float | int]:
    """One candidate's R@1 minus the reference's on the requests both answered (`request_key`), with
    the 95% paired bootstrap interval over users (`metrics.paired_bootstrap` with `groups`: a user's
    points move together), as the `paired_key` fields. NaN figures (n 0) when no request is shared.
    """
    key = paired_key(reference)
    mine = {request_key(r): r for r in rows.to_dict("records")}
    theirs = {request_key(r): r for r in reference_rows.to_dict("records")}
    shared = sorted(mine.keys() & theirs.keys())
    if not shared:
        nan = math.nan
        return {key: nan, f"{key}.low": nan, f"{key}.high": nan, f"{key}.half_width": nan, f"{key}.n": 0}
    a = user_values([mine[k] for k in shared])["recall@1"]  # [r]
    b = user_values([theirs[k] for k in shared])["recall@1"]  # [r]
    test = paired_bootstrap(a, b, n_boot, seed, groups=[user for _, user, _ in shared])
    return {
        key: test.mean_diff,
        f"{key}.low": test.low,
        f"{key}.high": test.high,
        f"{key}.half_width": (test.high - test.low) / 2.0,
        f"{key}.n": len(shared),
    }


def floor_screen(unforced_rate: float, n: int, floor: float, z: float) -> dict[str, Any]:
    """Whether a candidate can still reach the own-valid floor, from its first `n` requests.

    The Wilson score upper bound of its own valid rate at `z` (3.09: one-sided 0.1%); below
    `floor` the candidate is refused on the floor without decoding the rest of validation: at
    rl's tau 0.6 (own valid 3-7%) that saves ~85% of its two validation passes. A candidate within
    reach of the floor (bound >= floor) decodes every request. Were the first `n` a random sample,
    a candidate whose rate is at the floor would be cut with probability under 0.1%; they are the
    first in `select_requests` order (the same head the capped passes use), so a rate that drifts
    along that order adds to it, which is why `z` is set this far out.
    """
    if n <= 0 or math.isnan(unforced_rate):
        return {"n": n, "own_valid_upper": math.nan, "passed": True}
    centre = unforced_rate + z * z / (2 * n)
    spread = z * math.sqrt(unforced_rate * (1 - unforced_rate) / n + z * z / (4 * n * n))
    upper = min(1.0, (centre + spread) / (1 + z * z / n))
    return {"n": int(n), "own_valid_upper": float(upper), "passed": bool(upper >= floor)}


def meets_accuracy_gates(
    candidate: Mapping[str, Any],
    budget: float,
    reference: str = "ar_rl",
    min_unforced_rate: float | None = None,
) -> bool:
    """Whether `candidate` meets the gates that need no timing: the R@1 budget (its paired interval's
    lower bound >= -budget) and the own-valid floor. Only such a candidate can be served, so the
    inference node times no other (timing a refused candidate cost `rerank_rl` 17 s and chose nothing)."""
    low = candidate.get(f"{paired_key(reference)}.low", math.nan)
    own = -1.0 if min_unforced_rate is None else float(min_unforced_rate)
    # NaN bounds (no shared request) compare False: such a candidate never qualifies.
    return bool(low >= -budget - 1e-12) and candidate.get("unforced_rate", 1.0) >= own


def choose_operating_point(
    candidates: Sequence[Mapping[str, Any]],
    reference_recall: float,
    budget: float,
    reference: str = "ar_rl",
    min_unforced_rate: float | None = None,
    min_speed_ratio: float | None = None,
    speed_batch_size: int = 1,
) -> dict[str, Any]:
    """The fastest candidate whose paired R@1 interval against `reference` has `.low >= -budget`.

    Each candidate holds `tau`, `window` (None = the whole block), `recall@1`, the `paired_key`
    fields (`paired_recall`) and `tokens_per_s` (output tokens per second on validation prompts: the
    inference node times every candidate side by side, `operating_point.timing`); ties in speed go
    to the higher R@1. `min_unforced_rate`, when set, also requires the model's own valid rate
    (`unforced_rate`): a low tau can keep R@1 as served while the grammar writes most answers.
    `min_speed_ratio`, when set, also requires the timed speed-up over `reference` at
    `speed_batch_size` (`timed_speed_ratio`: the median over the timing rounds), the measure of the
    registration gate's speed check (`tracking/gate.py`, which then asks the low end of its own
    interval): a setting the reference outruns is not worth serving however accurate. The median, not
    the low end: with 3 rounds the low end is the slowest round, and one slow round refused rl at tau
    0.9 (1.12x median at batch 1) in one of two repeats. A candidate not timed beside the reference at
    that batch size does not qualify.
    `reference_recall` (the reference's R@1 on those requests) is recorded beside the choice.
    Raises `OperatingPointError` naming the best lower bound seen when nothing qualifies.
    """
    if not candidates:
        raise OperatingPointError("no decoding settings to choose an operating point from")
    low = f"{paired_key(reference)}.low"
    missing = [(c.get("tau"), c.get("window")) for c in candidates if low not in c]
    if missing:
        raise ValueError(f"candidates {missing} have no {low!r}: pair them with {reference} (paired_recall)")

    def faster(c: Mapping[str, Any]) -> bool:
        if min_speed_ratio is None:
            return True
        value = timed_speed_ratio(c, reference, speed_batch_size)
        return value is not None and value >= min_speed_ratio - 1e-12

    ok = [
        c for c in candidates if meets_accuracy_gates(c, budget, reference, min_unforced_rate) and faster(c)
    ]
    if not ok:
        best = max(candidates, key=lambda c: -math.inf if math.isnan(c[low]) else c[low])
        speed = timed_speed_ratio(best, reference, speed_batch_size)
        raise OperatingPointError(
            f"no (tau, window) has a paired R@1 interval against {reference} on validation with a lower "
            f"bound >= {-budget:+.3f} (the budget)"
            + ("" if min_unforced_rate is None else f" and an own valid rate >= {min_unforced_rate:.2f}")
            + (
                ""
                if min_speed_ratio is None
                else f" and a timed speed-up over {reference} >= {min_speed_ratio:.2f}x at batch {speed_batch_size}"
            )
            + f"; the best lower bound was {best[low]:+.3f} at tau {best['tau']}, window {best['window']} "
            f"(R@1 {best['recall@1']:.3f} vs {reference} {reference_recall:.3f}, own valid "
            f"{best.get('unforced_rate', math.nan):.2f}, speed-up at batch {speed_batch_size} "
            + ("not timed" if speed is None else f"{speed:.2f}x")
            + ")"
        )
    chosen = max(ok, key=lambda c: (c["tokens_per_s"], c["recall@1"]))
    return {
        "tau": float(chosen["tau"]),
        "window": None if chosen["window"] is None else int(chosen["window"]),
        "budget": float(budget),
        "min_unforced_rate": min_unforced_rate,
        "min_speed_ratio": min_speed_ratio,
        "speed_batch_size": speed_batch_size,
        "reference": reference,
        "reference_recall@1": float(reference_recall),
        "split": "valid",
        "rule": _rule(reference),
        "chosen": dict(chosen),
        "candidates": [dict(c) for c in candidates],
        "refused": None,
    }


def refused_operating_point(
    candidates: Sequence[Mapping[str, Any]],
    reference_recall: float,
    budget: float,
    reason: str,
    reference: str,
) -> dict[str, Any]:
    """The record of a system that has no operating point (kept so the report can say why)."""
    nan = math.nan
    return {
        "tau": None,
        "window": None,
        "budget": float(budget),
        "reference": reference,
        "reference_recall@1": float(reference_recall) if reference_recall is not None else nan,
        "split": "valid",
        "rule": _rule(reference),
        "chosen": None,
        "candidates": [dict(c) for c in candidates],
        "refused": reason,
    }


def resolve_operating_point(points: Mapping[str, Any] | None, system: str) -> tuple[float, int | None]:
    """(tau, window) of `system` from `operating_point.json`; a clear error when it has none."""
    if not points or system not in points:
        raise OperatingPointError(
            f"tau 'auto' for {system!r} but operating_point.json has no entry for it: it chooses none "
            "(not in inference.operating_point.systems), or the inference pipeline has not run (it "
            "chooses operating points on validation)"
        )
    point = points[system]
    if point.get("refused"):
        raise OperatingPointError(f"{system!r} has no operating point: {point['refused']}")
    return float(point["tau"]), point.get("window")
