"""The serving policy: the bars a model must clear to be served, stated once.

Two places decide whether a model may serve: the operating point's choice on validation
(`core/rank/operating_point.py`) and the registration gate on the newest test requests
(`core/registry/gate.py`). Both read one `Policy`, built from conf's `policy` block and handed to
both by the pipelines' nodes, so a floor or a level cannot differ between them:

* `min_unforced_rate`: the model's own valid rate (answers decoded without the grammar that the
  grammar accepts); served answers are valid by construction, so this is what sees a collapsed format;
* `min_speed_ratio`: its speed-up over the AR teacher (the median over timing rounds when choosing,
  the low end of its interval at the gate);
* `choice_margin`: on validation, the lower bound of the paired R@1 interval against the AR
  teacher at least ``-choice_margin``;
* `gate_margin`: at the gate, the same against the champion (or, first, the AR teacher);
* `prerank_margin`: in both, the same against the pre-rank (the retriever's order): a model that
  loses to the list it was handed has nothing to serve;
* `level`: the two-sided level of every paired interval above (and of the speed-up's coverage).

Every bar is ``value >= bar`` up to `TOLERANCE` (`clears`); a missing or NaN figure never clears.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["TOLERANCE", "Policy", "clears"]

# A mean of 0/1 hits minus a bar written in decimal (0.45 - 0.5) lands a few ulps off; a bar is met
# at `bar - TOLERANCE`, never further below.
TOLERANCE = 1e-12


def clears(value: float | None, bar: float) -> bool:
    """Whether `value` reaches `bar` (``>=``, up to `TOLERANCE`); None or NaN never does."""
    return value is not None and not math.isnan(value) and bool(value >= bar - TOLERANCE)


@dataclass(frozen=True)
class Policy:
    """What a served model must reach; the defaults are conf/base's `policy` (tests/test_config.py)."""

    level: float = 0.95  # two-sided level of every paired interval that decides
    min_unforced_rate: float = 0.5  # own valid rate (no grammar)
    min_speed_ratio: float = 1.0  # speed-up over the AR teacher
    choice_margin: float = 0.03  # validation: R@1 - AR teacher's, lower bound >= -choice_margin
    gate_margin: float = 0.05  # gate: R@1 - champion's (first: AR teacher's), lower bound >= -gate_margin
    prerank_margin: float = 0.05  # both: R@1 - pre-rank's, lower bound >= -prerank_margin

    def __post_init__(self) -> None:
        _within("level", self.level, 0.0, 1.0, open_ends=True)
        _within("min_unforced_rate", self.min_unforced_rate, 0.0, 1.0)
        _within("min_speed_ratio", self.min_speed_ratio, 0.0, math.inf)
        # R@1 differences lie in [-1, 1]; a negative margin asks for superiority
        for name in ("choice_margin", "gate_margin", "prerank_margin"):
            _within(name, getattr(self, name), -1.0, 1.0)

    @classmethod
    def from_params(cls, section: Mapping[str, Any]) -> Policy:
        """From `params["policy"]`: every field required, an unknown key refused (a typo would
        otherwise leave a bar at its default)."""
        own = {f.name for f in fields(cls)}
        unknown, missing = sorted(set(section) - own), sorted(own - set(section))
        if unknown or missing:
            raise ValueError(f"policy: unknown keys {unknown}, missing keys {missing}")
        return cls(**{name: float(section[name]) for name in own})

    def as_record(self) -> dict[str, float]:
        """Every bar by name, for the JSON records that were decided by it."""
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


def _within(name: str, value: Any, low: float, high: float, open_ends: bool = False) -> None:
    """Refuse a field that is not a finite number in [low, high] ((low, high) with `open_ends`),
    naming it."""
    ok = isinstance(value, int | float) and math.isfinite(value)
    ok = ok and (low < value < high if open_ends else low <= value <= high)
    if not ok:
        ends = f"({low}, {high})" if open_ends else f"[{low}, {high}]"
        raise ValueError(f"policy.{name}: {value!r} is not in {ends}")
