"""The operating point of a block-diffusion re-ranker: the (tau, window) it is served at
(docs/evaluation.md#how-the-operating-point-is-chosen).

Chosen on the *validation* split, never on test, under the serving policy (`core/evaluate/policy.py`,
the one the registration gate reads too): among the decoding settings tried there, the fastest
whose paired R@1 difference against the AR teacher on the same requests has a `level` interval
whose lower bound is at least ``-choice_margin`` (`paired_recall`: users resampled, as in the
evaluation), and whose difference against the pre-rank (the retriever's order) has one at least
``-prerank_margin``. A point estimate within the margin on ~190 requests, where that interval is
+-5-6 points, admits settings by chance; the lower bound admits only those shown to lose at most the
margin. Two more bars: the model's own valid rate (`min_unforced_rate`: answers the grammar did not
write) and the timed speed-up over the reference (`min_speed_ratio`: a diffusion setting the AR
model outruns buys nothing for its risk). A candidate missing a figure any bar reads is refused,
the refusal naming the figure. The choice (with every figure it was made from) is written to
`operating_point.json`, which `inference`, `benchmark` and serving read when their `tau` is `auto`.
When no setting clears every bar the system has no operating point: the file says why, and asking
for `auto` is a clear error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from diffusion_gr2.core.base.speed import (
    Ratio,
    geometric_mean_ratios,
    interval_fields,
    paired_ratios,
    ratio_interval,
    statistic,
    tokens_per_s,
)
from diffusion_gr2.core.evaluate.metrics import paired_bootstrap, request_key, user_values
from diffusion_gr2.core.evaluate.policy import Policy, clears

__all__ = [
    "PRERANK",
    "OperatingPointError",
    "accuracy_refusals",
    "choose_operating_point",
    "floor_screen",
    "meets_accuracy_gates",
    "paired_key",
    "paired_recall",
    "ranked_speed",
    "refused_operating_point",
    "resolve_operating_point",
    "speed_refusal",
    "speedup_key",
    "timed_speed_ratio",
]

PRERANK = "prerank"  # the retriever's order served as is: every served setting must not lose to it


class OperatingPointError(ValueError):
    """No decoding setting clears the policy's bars (or none was chosen for the system)."""


def paired_key(reference: str = "ar_rl") -> str:
    """Name of a candidate's paired R@1 difference against `reference` (`recall@1_vs_ar_rl`,
    `recall@1_vs_prerank`); its interval, half-width and request count are the `.low`, `.high`,
    `.half_width`, `.n` keys."""
    return f"recall@1_vs_{reference}"


def speedup_key(reference: str = "ar_rl") -> str:
    """Name of a candidate's timed speed-up over `reference` (`speedup_vs_ar_rl`, `ranked_speed`);
    `_low` and `_high` are its interval over the timing rounds, `_by_batch` the same per batch size."""
    return f"speedup_vs_{reference}"


def ranked_speed(
    by_batch: Mapping[int, Sequence[float]],
    reference: Mapping[int, Sequence[float]] | None = None,
    name: str = "ar_rl",
) -> dict[str, Any]:
    """A timed candidate's speed fields from its per-round tokens/s per batch size (`core/bench/benchmark.py::time_candidates`).

    `tokens_per_s_by_batch`: the harness statistic per batch size; `tokens_per_s`, the figure the
    operating point ranks by: per round the geometric mean over batch sizes (each weighs the same,
    whatever its scale), its median over rounds. With `reference`'s rounds (the same rounds):
    `speedup_vs_<name>` and its interval, from the per-round geometric mean of the ratios, and the
    same per batch size (`speedup_vs_<name>_by_batch`).
    """
    sizes = sorted(by_batch)
    per_round = geometric_mean_ratios([by_batch[b] for b in sizes])
    fields: dict[str, Any] = {
        "tokens_per_s_by_batch": {str(b): tokens_per_s(by_batch[b]) for b in sizes},
        "tokens_per_s": tokens_per_s(per_round),
        "tokens_per_s_by_round": per_round,
        "statistic": statistic(len(per_round)),
    }
    ratios: Ratio | None = None
    if reference is not None:
        paired = {b: paired_ratios(by_batch[b], reference[b]) for b in sizes}
        ratios = ratio_interval(geometric_mean_ratios([paired[b] for b in sizes]))
        fields[f"{speedup_key(name)}_by_batch"] = {
            str(b): interval_fields("speedup", ratio_interval(paired[b])) for b in sizes
        }
    return fields | interval_fields(speedup_key(name), ratios)


def timed_speed_ratio(candidate: Mapping[str, Any], reference: str, batch_size: int) -> float | None:
    """`candidate`'s timed speed-up over `reference` at `batch_size`, the median of its per-round
    ratios (None: not timed there)."""
    by_batch = candidate.get(f"{speedup_key(reference)}_by_batch") or {}
    value = (by_batch.get(str(batch_size)) or {}).get("speedup")
    return None if value is None or math.isnan(value) else float(value)


def _rule(reference: str, policy: Policy) -> str:
    """The admission rule in words, written beside every choice so the file reads on its own."""
    return (
        f"admitted: {paired_key(reference)}.low >= -budget and {paired_key(PRERANK)}.low >= "
        f"-prerank_margin ({policy.level:.0%} paired bootstrap over users), unforced_rate >= "
        f"min_unforced_rate and {speedup_key(reference)} at speed_batch_size (median over the timing "
        "rounds) >= min_speed_ratio; a missing figure refuses; "
        "served: the fastest admitted (tokens_per_s)"
    )


def paired_recall(
    rows: pd.DataFrame,
    reference_rows: pd.DataFrame,
    reference: str = "ar_rl",
    n_boot: int = 1000,
    seed: int = 0,
    *,
    level: float,
) -> dict[str, float | int]:
    """One candidate's R@1 minus the reference's on the requests both answered (`request_key`), with
    the paired bootstrap interval at `level` over users (`metrics.paired_bootstrap` with `groups`: a
    user's points move together), as the `paired_key` fields. NaN figures (n 0) when no request is
    shared.
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
    test = paired_bootstrap(a, b, n_boot, seed, level=level, groups=[user for _, user, _ in shared])
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


def _figure(candidate: Mapping[str, Any], key: str) -> float | None:
    """A candidate's figure, None when it is missing or NaN (no shared request): never a pass."""
    value = candidate.get(key)
    return None if value is None or math.isnan(float(value)) else float(value)


def accuracy_refusals(candidate: Mapping[str, Any], policy: Policy, reference: str = "ar_rl") -> list[str]:
    """Why `candidate` fails the bars that need no timing, in words (empty: it clears them): the
    paired R@1 lower bounds against `reference` (``-choice_margin``) and the pre-rank
    (``-prerank_margin``), and the own-valid floor. A missing figure is a refusal that names it."""
    bars = [
        (f"{paired_key(reference)}.low", -policy.choice_margin, f"paired with {reference}: paired_recall"),
        (f"{paired_key(PRERANK)}.low", -policy.prerank_margin, f"paired with {PRERANK}: paired_recall"),
        ("unforced_rate", policy.min_unforced_rate, "the own valid rate of the free pass"),
    ]
    out = []
    for key, bar, source in bars:
        value = _figure(candidate, key)
        if value is None:
            out.append(f"no {key} ({source})")
        elif not clears(value, bar):
            out.append(f"{key} {value:+.3f} < {bar:+.3f}")
    return out


def speed_refusal(
    candidate: Mapping[str, Any], policy: Policy, reference: str = "ar_rl", batch_size: int = 1
) -> str | None:
    """Why `candidate` fails the speed floor (`timed_speed_ratio` at `batch_size`), None when it
    clears it; a candidate not timed beside `reference` there cannot show it is faster."""
    value = timed_speed_ratio(candidate, reference, batch_size)
    if value is None:
        return f"speed-up over {reference} at batch {batch_size} not timed"
    if not clears(value, policy.min_speed_ratio):
        return f"speed-up over {reference} at batch {batch_size} {value:.2f}x < {policy.min_speed_ratio:.2f}x"
    return None


def meets_accuracy_gates(candidate: Mapping[str, Any], policy: Policy, reference: str = "ar_rl") -> bool:
    """Whether `candidate` clears the bars that need no timing (`accuracy_refusals`). Only such a
    candidate can be served, so the inference node times no other (timing a refused candidate cost
    `rerank_rl` 17 s and chose nothing)."""
    return not accuracy_refusals(candidate, policy, reference)


def _setting(c: Mapping[str, Any]) -> str:
    return f"tau {c.get('tau')}, window {c.get('window')}"


def _nothing_qualifies(
    candidates: Sequence[Mapping[str, Any]],
    reference_recall: float,
    policy: Policy,
    reference: str,
    batch: int,
) -> str:
    """The refusal: the bars, the candidate nearest the reference's bar, then each candidate's reasons."""
    low = f"{paired_key(reference)}.low"
    best = max(candidates, key=lambda c: -math.inf if _figure(c, low) is None else c[low])
    speed = timed_speed_ratio(best, reference, batch)
    # a candidate refused on accuracy is never timed: its speed is no reason of its own
    reasons = [
        f"{_setting(c)}: "
        + "; ".join(
            accuracy_refusals(c, policy, reference) or [str(speed_refusal(c, policy, reference, batch))]
        )
        for c in candidates
    ]
    return (
        f"no (tau, window) has a paired R@1 interval against {reference} on validation with a lower "
        f"bound >= {-policy.choice_margin:+.3f} (the budget), one against {PRERANK} with a lower bound "
        f">= {-policy.prerank_margin:+.3f} ({policy.level:.0%} intervals), an own valid rate >= "
        f"{policy.min_unforced_rate:.2f} and a timed speed-up over {reference} >= "
        f"{policy.min_speed_ratio:.2f}x at batch {batch}; the best lower bound was "
        f"{best.get(low, math.nan):+.3f} at {_setting(best)} (R@1 {best.get('recall@1', math.nan):.3f} "
        f"vs {reference} {reference_recall:.3f}, own valid {best.get('unforced_rate', math.nan):.2f}, "
        f"speed-up at batch {batch} " + ("not timed" if speed is None else f"{speed:.2f}x")
        + "); refused: " + " | ".join(reasons)
    )  # fmt: skip


def choose_operating_point(
    candidates: Sequence[Mapping[str, Any]],
    reference_recall: float,
    policy: Policy,
    reference: str = "ar_rl",
    speed_batch_size: int = 1,
) -> dict[str, Any]:
    """The fastest candidate that clears every bar of `policy`, with the record it was chosen by.

    Each candidate holds `tau`, `window` (None = the whole block), `recall@1`, `unforced_rate` (the
    model's own valid rate: a low tau can keep R@1 as served while the grammar writes most answers),
    the `paired_key` fields against `reference` and against `PRERANK` (`paired_recall`) and
    `tokens_per_s` (output tokens per second on validation prompts: the inference node times every
    admitted candidate side by side, `operating_point.timing`); ties in speed go to the higher R@1.
    The speed floor reads the timed speed-up over `reference` at `speed_batch_size`
    (`timed_speed_ratio`: the median over the timing rounds), the measure of the registration gate's
    speed check (`registry/gate.py`, which then asks the low end of its own interval). The median,
    not the low end: with 3 rounds the low end is the slowest round, and one slow round refused rl at
    tau 0.9 (1.12x median at batch 1) in one of two repeats.
    `reference_recall` (the reference's R@1 on those requests) is recorded beside the choice.
    Raises `OperatingPointError` naming the bars, the best lower bound seen and each candidate's
    reasons (a missing figure by name) when nothing qualifies.
    """
    if not candidates:
        raise OperatingPointError("no decoding settings to choose an operating point from")
    ok = [
        c
        for c in candidates
        if meets_accuracy_gates(c, policy, reference)
        and speed_refusal(c, policy, reference, speed_batch_size) is None
    ]
    if not ok:
        raise OperatingPointError(
            _nothing_qualifies(candidates, reference_recall, policy, reference, speed_batch_size)
        )
    chosen = max(ok, key=lambda c: (c["tokens_per_s"], c["recall@1"]))
    return {
        "tau": float(chosen["tau"]),
        "window": None if chosen["window"] is None else int(chosen["window"]),
        **_bars(policy),
        "min_unforced_rate": policy.min_unforced_rate,
        "min_speed_ratio": policy.min_speed_ratio,
        "speed_batch_size": speed_batch_size,
        "reference": reference,
        "reference_recall@1": float(reference_recall),
        "split": "valid",
        "rule": _rule(reference, policy),
        "chosen": dict(chosen),
        "candidates": [dict(c) for c in candidates],
        "refused": None,
    }


def _bars(policy: Policy) -> dict[str, float]:
    """The policy's R@1 bars as the record names them (`budget`: the margin against the reference)."""
    return {"budget": policy.choice_margin, "prerank_margin": policy.prerank_margin, "level": policy.level}


def refused_operating_point(
    candidates: Sequence[Mapping[str, Any]],
    reference_recall: float,
    policy: Policy,
    reason: str,
    reference: str,
) -> dict[str, Any]:
    """The record of a system that has no operating point (kept so the report can say why)."""
    nan = math.nan
    return {
        "tau": None,
        "window": None,
        **_bars(policy),
        "reference": reference,
        "reference_recall@1": float(reference_recall) if reference_recall is not None else nan,
        "split": "valid",
        "rule": _rule(reference, policy),
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
