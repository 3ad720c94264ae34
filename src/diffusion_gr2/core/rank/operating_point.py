"""The operating point of a block-diffusion re-ranker: the (tau, window) it is served at (DESIGN §8).

Chosen on the *validation* split, never on test: among the decoding settings tried there, the
fastest whose R@1 as served is within `budget` of the AR teacher's on the same requests. The choice
(with every figure it was made from) is written to `operating_point.json`, which `inference`,
`benchmark` and serving read when their `tau` is `auto`. When no setting meets the budget the
system has no operating point: the file says why, and asking for `auto` is a clear error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "OperatingPointError",
    "choose_operating_point",
    "refused_operating_point",
    "resolve_operating_point",
]


class OperatingPointError(ValueError):
    """No decoding setting meets the accuracy budget (or none was chosen for the system)."""


def choose_operating_point(
    candidates: Sequence[Mapping[str, Any]],
    reference_recall: float,
    budget: float,
    reference: str = "ar_rl",
    min_unforced_rate: float | None = None,
) -> dict[str, Any]:
    """The fastest candidate whose `recall@1` >= `reference_recall - budget`.

    Each candidate holds `tau`, `window` (None = the whole block), `recall@1` and `tokens_per_s`
    (output tokens per second on validation prompts: the inference node times every candidate side
    by side, `operating_point.timing`); ties in speed go to the higher R@1. `min_unforced_rate`,
    when set, also requires the model's own valid rate (`unforced_rate`): a low tau can keep R@1 as
    served while the grammar writes most answers.
    Raises `OperatingPointError` naming the best R@1 seen when nothing qualifies.
    """
    if not candidates:
        raise OperatingPointError("no decoding settings to choose an operating point from")
    floor = reference_recall - budget
    own = -1.0 if min_unforced_rate is None else float(min_unforced_rate)
    ok = [c for c in candidates if c["recall@1"] >= floor - 1e-12 and c.get("unforced_rate", 1.0) >= own]
    if not ok:
        best = max(candidates, key=lambda c: c["recall@1"])
        raise OperatingPointError(
            f"no (tau, window) reaches R@1 {floor:.3f} on validation ({reference} {reference_recall:.3f} "
            f"minus the budget {budget:.3f})"
            + ("" if min_unforced_rate is None else f" with an own valid rate >= {min_unforced_rate:.2f}")
            + f"; the best R@1 was {best['recall@1']:.3f} at tau {best['tau']}, window {best['window']}"
        )
    chosen = max(ok, key=lambda c: (c["tokens_per_s"], c["recall@1"]))
    return {
        "tau": float(chosen["tau"]),
        "window": None if chosen["window"] is None else int(chosen["window"]),
        "budget": float(budget),
        "min_unforced_rate": min_unforced_rate,
        "reference": reference,
        "reference_recall@1": float(reference_recall),
        "split": "valid",
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
        "chosen": None,
        "candidates": [dict(c) for c in candidates],
        "refused": reason,
    }


def resolve_operating_point(points: Mapping[str, Any] | None, system: str) -> tuple[float, int | None]:
    """(tau, window) of `system` from `operating_point.json`; a clear error when it has none."""
    if not points or system not in points:
        raise OperatingPointError(
            f"tau 'auto' for {system!r} but operating_point.json has no entry for it: run the inference "
            "pipeline first (it chooses the operating point on validation)"
        )
    point = points[system]
    if point.get("refused"):
        raise OperatingPointError(f"{system!r} has no operating point: {point['refused']}")
    return float(point["tau"]), point.get("window")
