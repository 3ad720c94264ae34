"""The promotion gate: challenger against champion on the same newest requests
(docs/operations.md#retraining).

The held-out requests are the test requests whose target is newest in time (the last
`slice_share` of them by target timestamp), in raw item ids so that models trained on different
data preparations (different internal ids, SIDs and tokenizers) are asked exactly the same thing.
A request a compared model cannot serve (an item outside its catalogue) is left out for all.

A challenger is promoted only when every check passes (`decide`), each bar the serving policy's
(`GateConfig.policy`, `core/evaluate/policy.py`: the one the operating point is chosen under):

* its own valid rate (`unforced_rate`: answers decoded without the grammar that the grammar accepts,
  `rerank.own_validity`, the figure inference reports) at least `min_unforced_rate` -- the served
  answers are valid by construction (their served valid rate is reported, never checked: under the
  grammar it cannot fail), so this is the check that sees a collapsed output format;
* non-inferior in R@1 to the pre-rank (the retriever's order, always: ``-prerank_margin``) and to the
  champion, or to the AR teacher when there is no champion yet (``-gate_margin``): the lower bound of
  the paired bootstrap interval (at `level`, resampling users) of the R@1 difference;
* its decoding speed (output tokens per second) at least `min_speed_ratio` times the AR teacher's on
  the same requests: the lower end of the speed-up's interval (per-round ratios of the one timing
  harness, `core/bench/harness.py`), timed apart from the accuracy pass, as the benchmark times it;
  an interval whose coverage falls short of `level` (too few `speed_rounds`: 6 at 95%) fails the check.

The AR teacher goes through the checks that apply to it (`decide_teacher`): its own valid rate and
non-inferiority to the pre-rank and to the teacher's champion; it is the speed reference, so it has
no speed check. It serves when no diffusion model does (`registry.served_champion`).

`benchmarks/gate_power.py` sizes the slice and the margin: a challenger at parity passes, one
clearly worse is refused (docs/operations.md).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import pandas as pd

from diffusion_gr2.core.base.speed import TimedRate, speedup
from diffusion_gr2.core.bench.harness import TimedSystem, round_rates, time_rounds
from diffusion_gr2.core.evaluate.metrics import paired_bootstrap
from diffusion_gr2.core.evaluate.policy import Policy, clears
from diffusion_gr2.core.serving.serving import Ranker, RequestError, parse_request

logger = logging.getLogger(__name__)

__all__ = [
    "Check",
    "GateConfig",
    "at_least",
    "decide",
    "decide_teacher",
    "newest_slice",
    "prerank_score",
    "score",
    "servable",
    "speeds",
]


@dataclass(frozen=True)
class GateConfig:
    """Which requests the gate uses and how it measures; what a challenger must reach is `policy`'s
    (margins, floors and level: the serving policy the operating point is chosen under too)."""

    slice_share: float = 0.5  # newest share of the test requests (by target time)
    max_requests: int = 640  # at most this many of them (CPU time)
    n_boot: int = 1000  # bootstrap resamples (of users)
    speed_batch_size: int = 1  # rows decoded together while timing (1 = one request's latency)
    speed_requests: int = 16  # timed on the first N gate requests
    speed_rounds: int = 6  # interleaved rounds: 6 make the range of the per-round ratios a 97% interval
    # (fewer cannot reach the policy's `level` 0.95: the speed check then fails, naming the coverage)
    policy: Policy = Policy()  # the bars; the nodes pass the run's (`params:policy`)


def newest_slice(
    candidates: pd.DataFrame, splits: pd.DataFrame, items: pd.DataFrame, config: GateConfig
) -> pd.DataFrame:
    """Test requests with the newest targets, in raw ids: ``request_id, history, candidates, target,
    timestamp, user``."""
    raw_of = dict(zip(items["item_id"].astype(int), items["raw_item_id"].astype(str), strict=True))
    test = candidates[candidates["split"] == "test"].merge(
        splits[["user_id", "test_timestamps"]], on="user_id"
    )
    # each test point at its own time: a user's later points are newer requests
    test = test.assign(
        test_timestamp=[int(ts[p]) for ts, p in zip(test["test_timestamps"], test["point"], strict=True)]
    )
    test = test.sort_values(["test_timestamp", "user_id"], ascending=[False, True], kind="stable")
    n = min(max(1, round(len(test) * config.slice_share)), config.max_requests, len(test))
    rows = test.head(n)
    return pd.DataFrame(
        {
            "request_id": [
                f"user-{u}-point-{p}" for u, p in zip(rows["user_id"], rows["point"], strict=True)
            ],
            "history": [[raw_of[int(i)] for i in h] for h in rows["history"]],
            "candidates": [[raw_of[int(i)] for i in c] for c in rows["candidates"]],
            "target": [raw_of[int(t)] for t in rows["target"]],
            "timestamp": rows["test_timestamp"].astype("int64").to_numpy(),
            "user": rows["user_id"].astype("int64").to_numpy(),  # paired intervals resample users
        }
    ).reset_index(drop=True)


def servable(requests: pd.DataFrame, rankers: Sequence[Ranker]) -> pd.DataFrame:
    """The requests every ranker can serve (each item in every catalogue)."""
    keep = []
    for i, record in enumerate(requests.to_dict("records")):
        try:
            for ranker in rankers:
                parse_request(i, record, ranker.known, ranker.limits)
            keep.append(i)
        except RequestError as err:
            logger.info("gate: request %s left out: %s", record.get("request_id"), err.message)
    return requests.iloc[keep].reset_index(drop=True)


def _answers(
    ranker: Ranker, records: list[dict[str, Any]], batch_size: int | None = None, own_valid: bool = False
) -> list[dict[str, Any]]:
    step = ranker.limits.max_requests
    out: list[dict[str, Any]] = []
    for lo in range(0, len(records), step):
        out += ranker.rank(ranker.parse(records[lo : lo + step]), batch_size=batch_size, own_valid=own_valid)
    return out


def score(ranker: Ranker, requests: pd.DataFrame) -> dict[str, Any]:
    """R@1 (with per-request hits), served and own valid rates of `ranker` on `requests`.

    Decoded as served (its own batching); the own valid rate from the free pass (`own_valid`).
    """
    records = requests.to_dict("records")
    answers = _answers(ranker, records, own_valid=True)
    hits = [float(a["ranking"][0] == r["target"]) for a, r in zip(answers, records, strict=True)]
    n = max(len(answers), 1)
    return {
        "n": float(len(answers)),
        "hits": hits,  # per request, for the paired intervals
        "recall@1": sum(hits) / n,
        "valid_rate": sum(a["valid"] for a in answers) / n,
        "unforced_rate": sum(bool(a["unforced"]) for a in answers) / n,
    }


def prerank_score(requests: pd.DataFrame) -> dict[str, Any]:
    """The pre-rank served as is (its first candidate): the floor every model must clear."""
    hits = [float(c[0] == t) for c, t in zip(requests["candidates"], requests["target"], strict=True)]
    return {"n": float(len(hits)), "hits": hits, "recall@1": sum(hits) / max(len(hits), 1)}


def speeds(
    rankers: dict[str, Ranker],
    requests: pd.DataFrame,
    config: GateConfig,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, TimedRate]:
    """Output tokens per second of each ranker on the same first `speed_requests`, by the one timing
    harness (`core/bench/harness.py`): a warm-up call each, then `speed_rounds` interleaved rounds in
    which every ranker decodes all of them, `speed_batch_size` rows a call.

    Each value is a `TimedRate`: a float, the median over rounds, carrying `tokens_per_s_by_round` and
    `statistic`; `speed.speedup(rates["challenger"], rates["teacher"])` is the speed-up paired by
    round with its interval.
    """
    records = requests.to_dict("records")[: config.speed_requests]
    b = config.speed_batch_size

    def timed(ranker: Ranker) -> TimedSystem[dict[str, Any]]:
        def run(batch: list[dict[str, Any]]) -> list[tuple[int, int]]:
            return [(int(a["output_tokens"]), int(a.get("nfe", 0))) for a in _answers(ranker, batch, b)]

        return TimedSystem(run, b)

    calls = config.speed_rounds * math.ceil(len(records) / b)  # every request once a round
    rounds = time_rounds(
        {n: timed(r) for n, r in rankers.items()}, records, config.speed_rounds, 1, calls, clock
    )
    return {name: TimedRate(round_rates(r)) for name, r in rounds.items()}


@dataclass(frozen=True)
class Check:
    """One threshold of the gate: the figure, the bar it must reach, and whether it did."""

    name: str
    value: float
    threshold: float
    passed: bool
    detail: str

    def line(self) -> str:
        mark = ">=" if self.passed else "<"
        return f"{self.name} = {self.value:.4f} {mark} {self.threshold:.4f} ({self.detail})"


def at_least(name: str, value: float, threshold: float, detail: str) -> Check:
    """The check `value >= threshold` (`policy.clears`: up to float noise; NaN never passes)."""
    return Check(name, float(value), float(threshold), clears(float(value), float(threshold)), detail)


def _non_inferior(
    name: str, challenger: dict[str, Any], other: dict[str, Any], config: GateConfig, users: Any
) -> tuple[Check, dict[str, float]]:
    """Paired R@1 difference challenger - `name` on the same requests at the policy's level; passes
    when low >= -margin (`prerank_margin` against the pre-rank, `gate_margin` against the rest)."""
    level = config.policy.level
    margin = config.policy.prerank_margin if name == "prerank" else config.policy.gate_margin
    paired = paired_bootstrap(challenger["hits"], other["hits"], config.n_boot, 0, level=level, groups=users)
    numbers = {
        f"recall@1_vs_{name}": paired.mean_diff,
        f"recall@1_vs_{name}.low": paired.low,
        f"recall@1_vs_{name}.high": paired.high,
    }
    detail = (
        f"challenger R@1 {challenger['recall@1']:.3f} vs {name} {other['recall@1']:.3f}, paired "
        f"{level:.0%} interval [{paired.low:+.3f}, {paired.high:+.3f}], margin {margin}"
    )
    return at_least(f"recall@1_vs_{name}.low", paired.low, -margin, detail), numbers


def _speed_check(challenger: float, teacher: float, config: GateConfig) -> tuple[Check, dict[str, float]]:
    """The challenger's speed-up over the teacher, paired by round with its interval (`speed.speedup`).

    A plain rate is one round. The check passes when the interval's lower end reaches
    `min_speed_ratio` and the interval covers at least `level`: with too few rounds its range claims a
    coverage it does not have (1 round: 0%, 5: 94%), so the check fails and says how many it needs.
    """
    level = config.policy.level
    rates = [r if isinstance(r, TimedRate) else TimedRate([float(r)]) for r in (challenger, teacher)]
    ratio = speedup(rates[0], rates[1], level)
    numbers = {
        "speed_ratio_vs_ar_rl": ratio.value,
        "speed_ratio_vs_ar_rl.low": ratio.low,
        "speed_ratio_vs_ar_rl.high": ratio.high,
        "speed_ratio_vs_ar_rl.coverage": ratio.coverage,
        "speed_ratio_vs_ar_rl.rounds": float(ratio.rounds),
    }
    detail = (
        f"{float(challenger):.0f} vs {float(teacher):.0f} output tokens/s, speed-up {ratio.value:.2f}x, "
        f"interval [{ratio.low:.2f}, {ratio.high:.2f}] ({ratio.coverage:.0%}, {ratio.rounds} per-round ratios)"
    )
    check = at_least("speed_ratio_vs_ar_rl.low", ratio.low, config.policy.min_speed_ratio, detail)
    if not clears(ratio.coverage, level):
        detail += f"; too few timing rounds: {ratio.rounds} cover {ratio.coverage:.1%} < {level:.0%}"
        check = Check(check.name, check.value, check.threshold, False, detail)
    return check, numbers


def _own_valid(side: dict[str, Any], config: GateConfig) -> Check:
    """The own-valid floor; a side without the figure fails it, saying so (never a pass by default)."""
    own = side.get("unforced_rate")
    detail = "the model's own valid rate: answers decoded without the grammar that it accepts"
    if own is None:
        detail = "no unforced_rate figure (the free pass was not scored): " + detail
    value = math.nan if own is None else float(own)
    return at_least("unforced_rate", value, config.policy.min_unforced_rate, detail)


def _verdict(
    checks: list[Check], numbers: dict[str, Any], config: GateConfig, first: str, sides: dict[str, Any]
) -> dict[str, Any]:
    """The report of one gate: promote when every check passed, else refuse naming the failed ones."""
    failed = [c for c in checks if not c.passed]
    if failed:
        decision, reasons = "refuse", "; ".join(c.line() for c in failed)
    else:
        decision, reasons = "promote", "every check passed" + first
    return {
        "decision": decision,
        "reasons": reasons,
        "decided_by": [c.name for c in failed] or [c.name for c in checks],
        "checks": [asdict(c) for c in checks],
        "numbers": numbers,
        "thresholds": {
            "margin": config.policy.gate_margin,
            "prerank_margin": config.policy.prerank_margin,
            "min_unforced_rate": config.policy.min_unforced_rate,
            "min_speed_ratio": config.policy.min_speed_ratio,
            "level": config.policy.level,
        },
        **{
            f"{side}_metrics": None if m is None else {k: v for k, v in m.items() if k != "hits"}
            for side, m in sides.items()
        },
    }


def decide(
    challenger: dict[str, Any],
    champion: dict[str, Any] | None,
    teacher: dict[str, Any],
    prerank: dict[str, Any],
    config: GateConfig,
    users: Sequence[Any] | None = None,
    shadow: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Promote when every check passes (module docstring), else refuse naming the checks that failed.

    `shadow` (`core/registry/shadow.py`: the challenger on the champion's logged requests) adds its
    ``checks`` and ``numbers``; the report keeps the rest of it under ``shadow``.

    Each side holds ``hits`` (per request, the same requests in the same order), ``recall@1``, and for
    the models ``valid_rate``, ``unforced_rate`` and ``output_tokens_per_s``. R@1 comparisons are
    paired (`paired_bootstrap`, whole `users` resampled): against the pre-rank always, against the
    champion when one serves, else against the AR teacher (the first promotion).
    """
    speed_check, speed = _speed_check(
        challenger["output_tokens_per_s"], teacher["output_tokens_per_s"], config
    )
    checks = [_own_valid(challenger, config)]
    numbers: dict[str, Any] = {}
    # the pre-rank always; the champion when one serves, else (first promotion) the AR teacher; the
    # teacher's paired figures are reported either way
    compared = [("prerank", prerank, True), ("teacher", teacher, champion is None)]
    compared += [("champion", champion, True)] if champion else []
    for name, other, checked in compared:
        check, figures = _non_inferior(name, challenger, other, config, users)
        checks += [check] if checked else []
        numbers |= figures
    checks.append(speed_check)
    numbers |= {
        "challenger.recall@1": challenger["recall@1"],
        "champion.recall@1": champion["recall@1"] if champion else None,
        "teacher.recall@1": teacher["recall@1"],
        "prerank.recall@1": prerank["recall@1"],
        "valid_rate": challenger["valid_rate"],  # reported: under the grammar it is 1 by construction
        "unforced_rate": challenger.get("unforced_rate"),
        "teacher.unforced_rate": teacher.get("unforced_rate"),
        **speed,
        "challenger.tokens_per_s": float(challenger["output_tokens_per_s"]),
        "teacher.tokens_per_s": float(teacher["output_tokens_per_s"]),
        "n_requests": challenger["n"],
    }
    if shadow is not None:
        checks += shadow["checks"]
        numbers |= shadow["numbers"]
    first = "" if champion else " (no champion yet: compared with the teacher)"
    sides = {"challenger": challenger, "champion": champion, "teacher": teacher, "prerank": prerank}
    report = _verdict(checks, numbers, config, first, sides)
    if shadow is not None:
        report["shadow"] = {k: v for k, v in shadow.items() if k != "checks"}
    return report


def decide_teacher(
    teacher: dict[str, Any],
    champion: dict[str, Any] | None,
    prerank: dict[str, Any],
    config: GateConfig,
    users: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """The AR teacher's own gate: its own valid rate, non-inferior R@1 to the pre-rank and to the
    teacher's champion when one serves. No speed check (it is the reference the speed-up is over).

    Sides as in `decide`; the teacher needs no ``output_tokens_per_s``.
    """
    checks = [_own_valid(teacher, config)]
    numbers: dict[str, Any] = {}
    for name, other in [("prerank", prerank)] + ([("champion", champion)] if champion else []):
        check, figures = _non_inferior(name, teacher, other, config, users)
        checks.append(check)
        numbers |= figures
    numbers |= {
        "challenger.recall@1": teacher["recall@1"],
        "champion.recall@1": champion["recall@1"] if champion else None,
        "prerank.recall@1": prerank["recall@1"],
        "valid_rate": teacher["valid_rate"],
        "unforced_rate": teacher.get("unforced_rate"),
        "n_requests": teacher["n"],
    }
    first = "" if champion else " (no teacher champion yet: compared with the pre-rank)"
    sides = {"challenger": teacher, "champion": champion, "prerank": prerank}
    return _verdict(checks, numbers, config, first, sides)
