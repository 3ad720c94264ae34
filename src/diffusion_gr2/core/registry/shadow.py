"""Shadow evaluation: the challenger replays the champion's last logged requests
(docs/operations.md#retraining).

The gate's own slice is the offline test split; this is the traffic the champion actually answered
(`core/serving/request_log.py`). The challenger re-ranks the last `last_requests` rows the served
champion logged, and the gate gets checks on:

* agreement with what was served: the share with the same top-1, and the mean Kendall tau between
  the two rankings of the same candidates;
* the challenger's own valid rate on that traffic (answers decoded without the grammar that it
  accepts; the served valid rate is reported: under the grammar it is 1 by construction);
* latency paired with the champion's: both decode the first `latency_requests` at batch 1,
  interleaved request by request, here on the same machine (the logged latencies were measured on
  the serving machine under its load, so they are reported, not compared); the check is the lower
  end of the median per-request speed-up's sign-test interval (`speed.speedup`);
* delayed feedback: where a later delivery holds a logged user's next interaction (the user's
  earliest delivered row whose item is not in the request's history), the realised hit rate (top-1
  = that item) of the served answer and of the challenger's, with a paired bootstrap interval over
  users (`metrics.paired_bootstrap`, the serving policy's `gate_margin` and `level`).

The evidence is checked first, each count against its minimum: `shadow.requests` (logged requests
of the serving champion that the compared models can serve, at least `min_requests`) and
`shadow.feedback_requests` (those with a delivered next interaction, at least `min_feedback`). With
too few logged requests the one failing check is `shadow.requests`, its detail saying both counts
found and needed and what to do (serve traffic, or `retrain.shadow.enabled=false`); nothing else is
judged. With enough of them but too little feedback, the other checks are judged and
`shadow.feedback_requests` fails in place of the hit rate (a `make register` has no delivery, so
no feedback). Too little traffic never passes for a good
challenger. With nothing serving yet (a first registration) there is no traffic and no check.
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

from diffusion_gr2.core.base.speed import speedup
from diffusion_gr2.core.evaluate.metrics import paired_bootstrap
from diffusion_gr2.core.evaluate.policy import clears
from diffusion_gr2.core.registry.gate import Check, GateConfig, at_least, servable
from diffusion_gr2.core.registry.registry import VersionRef
from diffusion_gr2.core.serving.serving import PrerankRanker, Ranker

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


# What a team does about missing evidence (the refusal's reason says it; `make register` logs it).
DISABLE = "or set retrain.shadow.enabled=false to gate on the offline slice alone"
SERVE = "serve traffic with `make serve` (serving.request_log on)"
DELIVER = "retrain on a delivery holding those users' next interactions (`make retrain`)"


def _no_traffic(
    champion: VersionRef, logged: int, n: int, fed: int, delivered: int, config: ShadowConfig
) -> Check:
    """The one failing check when too few logged requests: both counts found and needed, what to do."""
    left_out = (
        f" ({logged - n} of the {logged} logged left out: an item outside a catalogue)" if logged > n else ""
    )
    feedback = (
        f", and {fed} with a delivered next interaction, {config.min_feedback} needed"
        f"{'' if delivered else ' (this gate had no delivery)'}"
        if fed < config.min_feedback
        else ""
    )
    todo = SERVE + (f", then {DELIVER}" if fed < config.min_feedback else "")
    detail = (
        f"too few logged requests of the serving champion {champion.name} v{champion.version}: "
        f"{n} found, {config.min_requests} needed{left_out}{feedback}; not judged: {todo}, {DISABLE}"
    )
    return Check("shadow.requests", float(n), float(config.min_requests), False, detail)


def _feedback_evidence(fed: int, delivered: int, config: ShadowConfig) -> Check:
    """Requests with a delivered next interaction against `min_feedback` (the hit rate's evidence)."""
    what = f"logged requests with a delivered next interaction ({delivered} delivered rows)"
    if fed >= config.min_feedback:
        return at_least("shadow.feedback_requests", fed, config.min_feedback, f"{what}: {fed} found")
    detail = (
        f"too few {what}: {fed} found, {config.min_feedback} needed; the realised hit rate is not judged: "
        f"{DELIVER}, {DISABLE}"
    )
    return Check("shadow.feedback_requests", float(fed), float(config.min_feedback), False, detail)


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


def _evidence_counts(rows: pd.DataFrame, nexts: list[str | None]) -> dict[str, float]:
    """The replayed requests, those with feedback, and those whose next item was a candidate."""
    n, fed = len(rows), sum(t is not None for t in nexts)
    return {
        "shadow.requests": float(n),
        "shadow.feedback_requests": float(fed),
        "shadow.next_in_candidates": float(
            sum(
                t is not None and t in list(c)
                for t, c in zip(nexts, rows.get("candidates", []), strict=False)
            )
        ),
    }


def _agreement_numbers(rows: pd.DataFrame, answers: list[dict[str, Any]]) -> dict[str, float]:
    """The challenger's agreement with the served rankings, its valid rates, the champion's logged figures."""
    served = [list(r) for r in rows["ranking"]]
    mine = [a["ranking"] for a in answers]
    return {
        "shadow.top1_agreement": float(np.mean([a[0] == b[0] for a, b in zip(mine, served, strict=True)])),
        "shadow.rank_correlation": float(
            np.mean([_kendall(a, b) for a, b in zip(mine, served, strict=True)])
        ),
        "shadow.unforced_rate": float(np.mean([bool(a["unforced"]) for a in answers])),
        "shadow.valid_rate": float(np.mean([bool(a["valid"]) for a in answers])),
        "shadow.champion.valid_rate": float(rows["valid"].astype(bool).mean()),
        "shadow.champion.logged_latency_ms.p50": float(rows["latency_ms"].median()),
    }


def _agreement_checks(
    champion: VersionRef, n: int, numbers: dict[str, Any], gate: GateConfig, config: ShadowConfig
) -> list[Check]:
    """The evidence, top-1, rank-correlation and own-valid-rate checks on the replayed traffic."""
    top1, tau = numbers["shadow.top1_agreement"], numbers["shadow.rank_correlation"]
    own = numbers["shadow.unforced_rate"]
    return [
        at_least(
            "shadow.requests",
            n,
            config.min_requests,
            f"logged requests of {champion.name} v{champion.version} replayed",
        ),
        at_least("shadow.top1_agreement", top1, config.min_top1_agreement, "same top-1 as the served answer"),
        at_least(
            "shadow.rank_correlation", tau, config.min_rank_correlation, "mean Kendall tau to the served"
        ),
        at_least(
            "shadow.unforced_rate", own, gate.policy.min_unforced_rate, "own valid rate on logged traffic"
        ),
    ]


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
    logged = len(rows)
    rows = servable(rows, rankers) if not rows.empty else rows  # items a catalogue lacks: left out
    n = len(rows)
    nexts = next_interactions(rows, delivered)
    fed = sum(t is not None for t in nexts)
    report: dict[str, Any] = {"champion": asdict(champion), "requests": n}
    counts = _evidence_counts(rows, nexts)
    if n < config.min_requests:  # nothing is judged on too little traffic: one check says why
        check = _no_traffic(champion, logged, n, fed, len(delivered), config)
        return report | {"checks": [check], "numbers": counts}
    records = rows.to_dict("records")
    answers = _answers(challenger, records)
    mine = [a["ranking"] for a in answers]
    numbers: dict[str, Any] = counts | _agreement_numbers(rows, answers)
    checks = _agreement_checks(champion, n, numbers, gate, config)
    latency = _latency_check(challenger, champ, records, config, gate, numbers)
    if isinstance(champ, PrerankRanker):  # no decoder to be slower than: the figures are reported only
        report["latency"] = f"not checked: the champion is the pre-rank ({latency.detail})"
    else:
        checks.append(latency)
    checks.append(_feedback_evidence(fed, len(delivered), config))
    if checks[-1].passed:  # the realised hit rate only on enough feedback
        checks.append(_feedback_check(rows, mine, nexts, config, gate, numbers))
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
    level = gate.policy.level
    ratio = speedup([1.0 / x for x in ours], [1.0 / x for x in theirs], level)
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
    if not clears(ratio.coverage, level):
        detail += f"; too few timed requests: {len(timed)} cover {ratio.coverage:.1%} < {level:.0%}"
        check = Check(name, check.value, check.threshold, False, detail)
    return check


def _feedback_check(
    rows: pd.DataFrame,
    mine: list[list[str]],
    nexts: list[str | None],
    config: ShadowConfig,
    gate: GateConfig,
    numbers: dict[str, Any],
) -> Check:
    """Realised hit rate (top-1 = the user's next interaction, `nexts`) of the challenger and of the
    served answer; called with at least `min_feedback` of them."""
    name = "shadow.hit_rate_vs_champion.low"
    keep = [i for i, t in enumerate(nexts) if t is not None]
    ours = [float(mine[i][0] == nexts[i]) for i in keep]
    theirs = [float(rows["ranking"].iloc[i][0] == nexts[i]) for i in keep]
    users = [str(rows["user_id"].iloc[i]) for i in keep]
    level, margin = gate.policy.level, gate.policy.gate_margin
    paired = paired_bootstrap(ours, theirs, gate.n_boot, 0, level=level, groups=users)
    numbers |= {
        "shadow.hit_rate": float(np.mean(ours)),
        "shadow.champion.hit_rate": float(np.mean(theirs)),
        "shadow.hit_rate_vs_champion": paired.mean_diff,
        "shadow.hit_rate_vs_champion.low": paired.low,
        "shadow.hit_rate_vs_champion.high": paired.high,
    }
    detail = (
        f"realised hit rate {np.mean(ours):.3f} vs served {np.mean(theirs):.3f} on {len(keep)} requests, "
        f"paired {level:.0%} interval [{paired.low:+.3f}, {paired.high:+.3f}], margin {margin}"
    )
    return at_least(name, paired.low, -margin, detail)
