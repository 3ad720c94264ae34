"""Shadow evaluation: the challenger replays the champion's last logged requests (DESIGN §9).

The gate's own slice is the offline test split; this is the traffic the champion actually answered
(`core/tracking/request_log.py`). The challenger re-ranks the last `last_requests` rows the served
champion logged, and the gate gets checks on:

* agreement with what was served: the share with the same top-1, and the mean Kendall tau between
  the two rankings of the same candidates;
* the challenger's own valid rate on that traffic (answers decoded without the grammar that it
  accepts; the served valid rate is reported: under the grammar it is 1 by construction);
* latency paired with the champion's: both decode the first `latency_requests` at batch 1,
  interleaved request by request, here on the same machine (the logged latencies were measured on
  the serving machine under its load, so they are reported, not compared); the check is the lower
  end of the median per-request speed-up's sign-test interval (`harness.speedup`);
* delayed feedback: where a later delivery holds a logged user's next interaction (the user's
  earliest delivered row whose item is not in the request's history), the realised hit rate (top-1
  = that item) of the served answer and of the challenger's, with a paired bootstrap interval over
  users (`metrics.paired_bootstrap`, the gate's margin and level).

A check with fewer requests than its minimum fails and says so: too little traffic never passes for
a good challenger. With nothing serving yet (a first registration) there is no traffic and no check.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd
from scipy.stats import kendalltau

from diffusion_gr2.core.bench.harness import speedup
from diffusion_gr2.core.evaluate.metrics import paired_bootstrap
from diffusion_gr2.core.tracking.gate import Check, GateConfig, at_least, servable
from diffusion_gr2.core.tracking.registry import VersionRef
from diffusion_gr2.core.tracking.serving import PrerankRanker, Ranker

logger = logging.getLogger(__name__)

__all__ = ["ShadowConfig", "champion_requests", "evaluate", "next_interactions"]


@dataclass(frozen=True)
class ShadowConfig:
    """Which logged requests are replayed and what the challenger must reach on them."""

    enabled: bool = True
    last_requests: int = 256  # the champion's newest logged requests replayed
    min_requests: int = 50  # fewer logged requests: every shadow check fails, saying so
    min_feedback: int = 30  # fewer with a delivered next interaction: the hit-rate check fails
    min_top1_agreement: float = 0.2  # share with the served top-1
    min_rank_correlation: float = 0.2  # mean Kendall tau to the served ranking
    min_speedup: float = 0.8  # per-request speed-up over the champion (low end): at most 1.25x slower
    latency_requests: int = 16  # timed at batch 1 on the first of them, interleaved with the champion


def champion_requests(log: pd.DataFrame, champion: VersionRef, n: int) -> pd.DataFrame:
    """The last `n` logged rows answered by `champion` (name and version), oldest first."""
    if log.empty or "model_name" not in log:
        return log.head(0)
    mine = log[(log["model_name"] == champion.name) & (log["model_version"].astype(str) == champion.version)]
    return mine.tail(n).reset_index(drop=True)


def next_interactions(requests: pd.DataFrame, delivered: pd.DataFrame) -> list[str | None]:
    """Each logged request's next interaction in the delivery (raw item id), None when it holds none.

    The user's earliest delivered row (by time, then file order) whose item is not in the request's
    history; requests without a `user_id` get None.
    """
    if delivered.empty or "user_id" not in requests:
        return [None] * len(requests)
    rows = delivered.assign(order=np.arange(len(delivered))).sort_values(["timestamp", "order"])
    by_user = rows.groupby(rows["raw_user_id"].astype(str))["raw_item_id"].agg(lambda s: [str(i) for i in s])
    found = []
    for user, history in zip(requests["user_id"], requests["history"], strict=True):
        seen = set(history or [])
        items = by_user.get(str(user), []) if user is not None else []
        found.append(next((i for i in items if i not in seen), None))
    return found


def _too_few(name: str, n: int, minimum: int, what: str) -> Check:
    return Check(name, float(n), float(minimum), False, f"too few {what}: {n} < {minimum}; not judged")


def _kendall(a: Sequence[str], b: Sequence[str]) -> float:
    """Kendall tau between two rankings of the same items (1: same order, -1: reversed)."""
    pos = {item: i for i, item in enumerate(b)}
    tau = kendalltau(range(len(a)), [pos[i] for i in a]).statistic
    return 0.0 if math.isnan(tau) else float(tau)


def _latencies(
    challenger: Ranker, champion: Any, records: list[dict[str, Any]]
) -> tuple[list[float], list[float]]:
    """Per-request latency (ms) of both at batch 1, interleaved (who goes first alternates)."""
    ours, theirs = [], []
    for i, record in enumerate(records):
        order = [(challenger, ours), (champion, theirs)]
        for ranker, out in order if i % 2 == 0 else order[::-1]:
            (answer,) = ranker.rank(ranker.parse([record]), batch_size=1)
            out.append(max(float(answer["latency_ms"]), 1e-3))
    return ours, theirs


def _answers(ranker: Ranker, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    step = ranker.limits.max_requests
    out: list[dict[str, Any]] = []
    for lo in range(0, len(records), step):
        out += ranker.rank(ranker.parse(records[lo : lo + step]), own_valid=True)
    return out


def evaluate(
    challenger: Ranker,
    champion: VersionRef | None,
    load: Callable[[str], Any],
    log: pd.DataFrame,
    delivered: pd.DataFrame,
    gate: GateConfig,
    config: ShadowConfig,
) -> dict[str, Any]:
    """The shadow report: ``checks`` (`gate.Check`), ``numbers`` and what was replayed.

    `champion` is the version serving when the gate runs (None: nothing served, so nothing was
    logged); `load` turns its URI into a ranker for the paired latency; `log` is `read_log`'s frame;
    `delivered` the delivery's raw rows (``raw_user_id, raw_item_id, timestamp``).
    """
    if champion is None:  # a first registration: nothing has served, so there is nothing to replay
        return {"champion": None, "requests": 0, "checks": [], "numbers": {}, "skipped": "nothing serves yet"}
    rows = champion_requests(log, champion, config.last_requests)
    champ = load(champion.uri) if not rows.empty else None
    rankers = [challenger] + ([champ] if champ is not None else [])
    rows = servable(rows, rankers) if not rows.empty else rows  # items a catalogue lacks: left out
    n = len(rows)
    report: dict[str, Any] = {"champion": asdict(champion), "requests": n}
    if n < config.min_requests:
        names = ["top1_agreement", "rank_correlation", "unforced_rate", "speedup_vs_champion.low"]
        checks = [_too_few(f"shadow.{x}", n, config.min_requests, "logged requests") for x in names]
        checks.append(
            _too_few("shadow.hit_rate_vs_champion.low", 0, config.min_feedback, "requests with feedback")
        )
        return report | {"checks": checks, "numbers": {"shadow.requests": float(n)}}
    records = rows.to_dict("records")
    answers = _answers(challenger, records)
    served = [list(r) for r in rows["ranking"]]
    mine = [a["ranking"] for a in answers]
    top1 = float(np.mean([a[0] == b[0] for a, b in zip(mine, served, strict=True)]))
    tau = float(np.mean([_kendall(a, b) for a, b in zip(mine, served, strict=True)]))
    own = float(np.mean([bool(a["unforced"]) for a in answers]))
    numbers: dict[str, Any] = {
        "shadow.requests": float(n),
        "shadow.top1_agreement": top1,
        "shadow.rank_correlation": tau,
        "shadow.unforced_rate": own,
        "shadow.valid_rate": float(np.mean([bool(a["valid"]) for a in answers])),
        "shadow.champion.valid_rate": float(rows["valid"].astype(bool).mean()),
        "shadow.champion.logged_latency_ms.p50": float(rows["latency_ms"].median()),
    }
    checks = [
        at_least("shadow.top1_agreement", top1, config.min_top1_agreement, "same top-1 as the served answer"),
        at_least(
            "shadow.rank_correlation", tau, config.min_rank_correlation, "mean Kendall tau to the served"
        ),
        at_least("shadow.unforced_rate", own, gate.min_unforced_rate, "own valid rate on logged traffic"),
    ]
    latency = _latency_check(challenger, champ, records, config, gate, numbers)
    if isinstance(champ, PrerankRanker):  # no decoder to be slower than: the figures are reported only
        report["latency"] = f"not checked: the champion is the pre-rank ({latency.detail})"
    else:
        checks.append(latency)
    checks.append(_feedback_check(rows, mine, delivered, config, gate, numbers))
    return report | {"checks": checks, "numbers": numbers}


def _latency_check(
    challenger: Ranker,
    champ: Any,
    records: list[dict[str, Any]],
    config: ShadowConfig,
    gate: GateConfig,
    numbers: dict[str, Any],
) -> Check:
    """Per-request speed-up over the champion (its latency over ours), paired by request."""
    name = "shadow.speedup_vs_champion.low"
    timed = records[: config.latency_requests]
    ours, theirs = _latencies(challenger, champ, timed)
    numbers["shadow.latency_ms.p50"] = float(np.median(ours))
    numbers["shadow.champion.latency_ms.p50"] = float(np.median(theirs))
    ratio = speedup([1.0 / x for x in ours], [1.0 / x for x in theirs], gate.level)
    numbers |= {
        "shadow.speedup_vs_champion": ratio.value,
        "shadow.speedup_vs_champion.low": ratio.low,
        "shadow.speedup_vs_champion.high": ratio.high,
    }
    detail = (
        f"median per-request speed-up {ratio.value:.2f}x [{ratio.low:.2f}, {ratio.high:.2f}] "
        f"({ratio.coverage:.0%}) over {len(timed)} requests at batch 1"
    )
    check = at_least(name, ratio.low, config.min_speedup, detail)
    if ratio.coverage < gate.level - 1e-12:
        detail += f"; too few timed requests: {len(timed)} cover {ratio.coverage:.1%} < {gate.level:.0%}"
        check = Check(name, check.value, check.threshold, False, detail)
    return check


def _feedback_check(
    rows: pd.DataFrame,
    mine: list[list[str]],
    delivered: pd.DataFrame,
    config: ShadowConfig,
    gate: GateConfig,
    numbers: dict[str, Any],
) -> Check:
    """Realised hit rate (top-1 = the user's next interaction) of the challenger and of the served answer."""
    name = "shadow.hit_rate_vs_champion.low"
    nexts = next_interactions(rows, delivered)
    keep = [i for i, t in enumerate(nexts) if t is not None]
    numbers["shadow.feedback_requests"] = float(len(keep))
    numbers["shadow.next_in_candidates"] = float(
        sum(nexts[i] in list(rows["candidates"].iloc[i]) for i in keep)
    )
    if len(keep) < config.min_feedback:
        return _too_few(name, len(keep), config.min_feedback, "requests with a delivered next interaction")
    ours = [float(mine[i][0] == nexts[i]) for i in keep]
    theirs = [float(rows["ranking"].iloc[i][0] == nexts[i]) for i in keep]
    users = [str(rows["user_id"].iloc[i]) for i in keep]
    paired = paired_bootstrap(ours, theirs, gate.n_boot, 0, gate.level, groups=users)
    numbers |= {
        "shadow.hit_rate": float(np.mean(ours)),
        "shadow.champion.hit_rate": float(np.mean(theirs)),
        "shadow.hit_rate_vs_champion": paired.mean_diff,
        "shadow.hit_rate_vs_champion.low": paired.low,
        "shadow.hit_rate_vs_champion.high": paired.high,
    }
    detail = (
        f"realised hit rate {np.mean(ours):.3f} vs served {np.mean(theirs):.3f} on {len(keep)} requests, "
        f"paired {gate.level:.0%} interval [{paired.low:+.3f}, {paired.high:+.3f}], margin {gate.margin}"
    )
    return at_least(name, paired.low, -gate.margin, detail)
