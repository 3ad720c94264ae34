"""The one metrics module: ranking metrics with a single relevant item, bootstrap intervals
(docs/evaluation.md#metrics-and-the-reward).

Per user the only input is the 1-based rank of the target (0 = absent): Recall@K = 1[rank <= K],
NDCG@K = 1/log2(rank + 1) if rank <= K (the ideal DCG is 1 with one relevant item), reciprocal rank
1/rank. Intervals are percentile bootstraps over users, seeded and vectorised; the same resamples are
used for every metric of a system. Full-catalog helpers serve the first-stage retriever. Reasoning quality is measured without an LLM
judge, from the answer text and the prompt alone (`REASONING_METRICS`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import torch

__all__ = [
    "METRICS",
    "REASONING_METRICS",
    "PairedBootstrap",
    "PromptContext",
    "REQUEST_KEY",
    "bootstrap_ci",
    "cited_sids",
    "explanation_of",
    "ndcg_at_k",
    "own_valid_flags",
    "paired_bootstrap",
    "prompt_contexts",
    "recall_at_k",
    "recall_ndcg_at_k",
    "reasoning_metrics",
    "reasoning_values",
    "reciprocal_rank",
    "request_key",
    "stated_top_pick",
    "system_metrics",
    "target_rank",
    "target_ranks",
    "user_values",
]

METRICS = (
    "recall@1",
    "recall@3",
    "recall@5",
    "ndcg@3",
    "ndcg@5",
    "mrr",
    "valid_rate",
    "unforced_rate",
    "fallback_rate",
    "recall@1_unforced",
    "prerank_copy_rate",
    "copy_against_evidence_rate",
)
# What identifies a request (docs/evaluation.md): a user asked at one held-out time point of a split.
# Systems are paired on it; a user alone is not enough once a user has several test points.
REQUEST_KEY = ("split", "user_id", "point")
_CHUNK_ELEMENTS = 4_000_000  # bootstrap/catalog work is chunked to bound memory (~32 MB of float64)


def recall_at_k(ranks: Sequence[int] | np.ndarray, k: int) -> np.ndarray:
    """Per-user Recall@K: ranks [u] (1-based, 0 = absent) -> [u] of 0.0/1.0."""
    r = np.asarray(ranks)
    return ((r >= 1) & (r <= k)).astype(np.float64)


def ndcg_at_k(ranks: Sequence[int] | np.ndarray, k: int) -> np.ndarray:
    """Per-user NDCG@K with one relevant item: 1/log2(rank + 1) if 1 <= rank <= K, else 0."""
    r = np.asarray(ranks, dtype=np.float64)
    hit = (r >= 1) & (r <= k)
    return np.where(hit, 1.0 / np.log2(np.where(hit, r, 1.0) + 1.0), 0.0)


def reciprocal_rank(ranks: Sequence[int] | np.ndarray) -> np.ndarray:
    """Per-user reciprocal rank 1/rank (0 when absent); its mean is the MRR."""
    r = np.asarray(ranks, dtype=np.float64)
    return np.where(r >= 1, 1.0 / np.maximum(r, 1.0), 0.0)


def target_rank(ranking: Iterable[Hashable] | None, target: Hashable) -> int:
    """1-based position of ``target`` in ``ranking``; 0 when absent or when there is no ranking."""
    if ranking is None:
        return 0
    for position, item in enumerate(ranking, start=1):
        if item == target:
            return position
    return 0


def request_key(row: Mapping[str, Any]) -> tuple[str, int, int]:
    """`REQUEST_KEY` of one row; a row without `split`/`point` is a test row at point 0 (leave-one-out)."""
    return (str(row.get("split", "test")), int(row["user_id"]), int(row.get("point", 0)))


def _rows(frame: pd.DataFrame | Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Rows as mappings, whether given as a frame or as an iterable of dicts."""
    if isinstance(frame, pd.DataFrame):
        return frame.to_dict("records")
    return list(frame)


def _final_ranking(row: Mapping[str, Any]) -> Any:
    """The ranking that was served: the row's ranking, or its pre-rank when the output gave none."""
    ranking = row.get("ranking")
    if ranking is None or (not isinstance(ranking, str) and len(ranking) == 0):
        return row.get("prerank")
    return ranking


def user_values(frame: pd.DataFrame | Iterable[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """Per-user value of every metric in :data:`METRICS` (each [u]).

    Rows need ``target``, ``ranking`` (after fallback) and ``valid``; an invalid output is served the
    pre-rank order, so ``fallback_rate`` is the share of invalid rows, and a row without a ranking is
    ranked by its ``prerank`` when present. ``unforced_rate`` is the share of rows whose own answer
    (free greedy decoding) the grammar accepts: ``unforced`` when the row has it (`rerank` writes it),
    else valid with no correction (``forced`` = 0, the default when absent). It is the model's own
    valid-output rate, which equals ``valid_rate`` for unconstrained decoding.
    ``recall@1_unforced`` is the R@1 of serving the model's own answer (``unforced_ranking``, or the
    served one when the row has none) where the grammar accepts it and the pre-rank everywhere else.
    It is not free decoding's R@1: the grammar is stricter than the parser (key order, spacing,
    escapes), so an answer it rejects may still have parsed, and free decoding would serve that
    ranking, better or worse than the pre-rank. On every other row the two policies agree.
    ``prerank_copy_rate`` is the share of rows whose own answer is valid and lists the candidates in
    the pre-rank's order, unchanged: a re-ranker that wrote a valid list without re-ranking it (the
    pre-rank itself: 1). A model can raise its own valid rate by copying the list it is shown; this
    says how much of that rate re-ranks nothing. ``copy_against_evidence_rate`` is the share of rows
    whose own valid answer is such a copy although the evidence ranks another candidate first
    (``evidence_first``: the learned analyst's first pick, which the prompt's hint names first;
    rows without it count 0). Where the evidence agrees with the retriever's first, the teacher's
    own answer is a copy too (its pick first, the retriever's order after); these copies are the ones
    that ignore what the prompt says.
    """
    rows = _rows(frame)
    ranks = np.array([target_rank(_final_ranking(r), r["target"]) for r in rows], dtype=np.int64)
    valid = np.array([bool(r["valid"]) for r in rows], dtype=np.float64)
    unforced = np.array(
        [
            bool(r["unforced"]) if "unforced" in r else bool(r["valid"]) and not r.get("forced", 0)
            for r in rows
        ],
        dtype=np.float64,
    )
    own = [_own_ranking(r) if ok else None for ok, r in zip(unforced, rows, strict=True)]  # valid ones
    unforced_ranks = np.array(
        [
            target_rank(r.get("prerank") if mine is None else mine, r["target"])
            for mine, r in zip(own, rows, strict=True)
        ],
        dtype=np.int64,
    )
    copies, against = _copy_flags(own, rows)
    return {
        "recall@1": recall_at_k(ranks, 1),
        "recall@3": recall_at_k(ranks, 3),
        "recall@5": recall_at_k(ranks, 5),
        "ndcg@3": ndcg_at_k(ranks, 3),
        "ndcg@5": ndcg_at_k(ranks, 5),
        "mrr": reciprocal_rank(ranks),
        "valid_rate": valid,
        "unforced_rate": unforced,
        "fallback_rate": 1.0 - valid,
        "recall@1_unforced": recall_at_k(unforced_ranks, 1),
        "prerank_copy_rate": copies,
        "copy_against_evidence_rate": against,
    }


def _own_ranking(row: Mapping[str, Any]) -> Any:
    """The model's own answer: the free pass's ranking where the row has one, else the served one."""
    return row["unforced_ranking"] if "unforced_ranking" in row else _final_ranking(row)


def _same_order(ranking: Any, prerank: Any) -> bool:
    """Whether a ranking lists exactly the pre-rank's items in the pre-rank's order (False without one)."""
    if ranking is None or prerank is None or isinstance(ranking, str) or len(prerank) == 0:
        return False
    return [int(i) for i in ranking] == [int(i) for i in prerank]


def _copy_flags(own: Sequence[Any], rows: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """Per row: whether its own valid answer (`own`, None where invalid) is the pre-rank's list
    unchanged, and whether it is such a copy although the evidence ranks another candidate first."""
    copies = [
        mine is not None and _same_order(mine, r.get("prerank")) for mine, r in zip(own, rows, strict=True)
    ]
    against = [
        c and _evidence_differs(r.get("evidence_first"), r.get("prerank"))
        for c, r in zip(copies, rows, strict=True)
    ]
    return np.array(copies, dtype=np.float64), np.array(against, dtype=np.float64)


def _evidence_differs(first: Any, prerank: Any) -> bool:
    """Whether the evidence's first pick is known and is not the pre-rank's first item."""
    if first is None or prerank is None or len(prerank) == 0 or pd.isna(first):
        return False
    return int(first) != int(prerank[0])


def own_valid_flags(rows: pd.DataFrame) -> pd.Series:
    """Rows whose own (free greedy) answer the grammar accepts: what free decoding gets right (the
    rows' `unforced_rate`, as `user_values` counts it)."""
    if "unforced" in rows:
        return rows["unforced"].astype(bool)
    return rows["valid"] & (rows["forced"] == 0)  # rankings written before the column existed


def _bootstrap_means(
    values: np.ndarray, n_boot: int, seed: int, groups: Sequence[Hashable] | np.ndarray | None = None
) -> np.ndarray:
    """Means of ``n_boot`` resamples: values [m, r] -> [m, n_boot] (same resamples for every row).

    ``groups`` ([r], e.g. user ids) makes it a cluster bootstrap: whole groups are drawn with
    replacement and the mean is over every request they hold. A user asked at several time points
    answers them alike; resampling the requests one by one would treat them as independent and
    give intervals narrower than the data supports. None = every request is its own group.
    """
    m, r = values.shape
    if groups is None:
        sums, sizes = values, np.ones(r)
    else:
        _, cluster = np.unique(np.asarray(groups), return_inverse=True)
        sizes = np.bincount(cluster).astype(np.float64)  # [g] requests per group
        sums = np.stack([np.bincount(cluster, weights=row, minlength=len(sizes)) for row in values])
    g = sums.shape[1]
    rng = np.random.default_rng(seed)
    out = np.empty((m, n_boot))
    chunk = max(1, _CHUNK_ELEMENTS // max(m * g, 1))
    for start in range(0, n_boot, chunk):
        c = min(chunk, n_boot - start)
        idx = rng.integers(0, g, size=(c, g))  # [c, g] groups drawn with replacement
        out[:, start : start + c] = sums[:, idx].sum(axis=2) / sizes[idx].sum(axis=1)  # [m, c]
    return out


def bootstrap_ci(
    values: Mapping[str, np.ndarray],
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    groups: Sequence[Hashable] | np.ndarray | None = None,
) -> dict[str, list[float]]:
    """Percentile bootstrap interval for the mean of each per-request array ([r] each).

    ``groups``: resample whole groups (users) instead of requests (`_bootstrap_means`).
    """
    names = list(values)
    stacked = np.stack([np.asarray(values[k], dtype=np.float64) for k in names])  # [m, r]
    if stacked.shape[1] == 0:
        return {k: [float("nan"), float("nan")] for k in names}
    means = _bootstrap_means(stacked, n_boot, seed, groups)  # [m, n_boot]
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(means, [tail, 100.0 - tail], axis=1)  # [m] each
    return {k: [float(lo), float(hi)] for k, lo, hi in zip(names, low, high, strict=True)}


def system_metrics(
    frame: pd.DataFrame | Iterable[Mapping[str, Any]], n_boot: int = 1000, seed: int = 0, level: float = 0.95
) -> dict[str, Any]:
    """Metrics of one system: ``n``, every name in :data:`METRICS`, and ``ci`` (metric -> [low, high]).

    Intervals resample users (every request of a drawn user), not requests: see `_bootstrap_means`.
    """
    rows = _rows(frame)
    values = user_values(rows)
    n = len(values["mrr"])
    means = {k: float(v.mean()) if n else float("nan") for k, v in values.items()}
    users = [r["user_id"] for r in rows] if rows and "user_id" in rows[0] else None
    return {"n": n, **means, "ci": bootstrap_ci(values, n_boot, seed, level, users)}


class PairedBootstrap(NamedTuple):
    """Mean of (a - b) over the paired requests, its bootstrap interval, and the two-sided sign share.

    ``sign_share`` = 2 * min(share of resampled means <= 0, share >= 0), capped at 1: a bootstrap
    summary of how firmly the resamples agree on the sign of ``mean_diff``, not a test's p-value.
    """

    mean_diff: float
    low: float
    high: float
    sign_share: float  # 0 = every resample on one side of 0; 1 = half or more on each side (or all at 0)


def paired_bootstrap(
    a_values: Sequence[float] | np.ndarray,
    b_values: Sequence[float] | np.ndarray,
    n_boot: int = 1000,
    seed: int = 0,
    *,
    level: float,
    groups: Sequence[Hashable] | np.ndarray | None = None,
) -> PairedBootstrap:
    """Paired bootstrap of a per-request metric for systems a and b scored on the same requests.

    Resampling requests (not each system separately) keeps the pairing, so the shared per-request
    difficulty cancels and small differences between close systems can be resolved. ``groups``
    ([r], user ids) resamples whole users instead (`_bootstrap_means`). `level` (two-sided) has no
    default: every interval that decides states its level (`core/evaluate/policy.py`).
    """
    a, b = np.asarray(a_values, dtype=np.float64), np.asarray(b_values, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"need two non-empty per-request arrays of one length, got {a.shape} and {b.shape}")
    diff = a - b
    boot = _bootstrap_means(diff[None, :], n_boot, seed, groups)[0]  # [n_boot]
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(boot, [tail, 100.0 - tail])
    share = min(1.0, 2.0 * min(float(np.mean(boot <= 0)), float(np.mean(boot >= 0))))
    return PairedBootstrap(float(diff.mean()), float(low), float(high), share)


def target_ranks(scores: torch.Tensor | np.ndarray, targets: Sequence[int] | np.ndarray) -> np.ndarray:
    """Full-catalog 1-based rank of each target: scores [u, i], targets [u] -> ranks [u].

    rank = 1 + items scored higher + tied items with a smaller index, i.e. ties are broken by item
    index as a stable descending sort would, so a popularity baseline full of ties is not flattered.
    Mask items the user may not be recommended (history) with -inf before calling.
    """
    s = torch.as_tensor(scores)
    t = torch.as_tensor(np.asarray(targets), dtype=torch.long, device=s.device)
    u, i = s.shape
    item = torch.arange(i, device=s.device).unsqueeze(0)  # [1, i]
    ranks = torch.empty(u, dtype=torch.long, device=s.device)
    step = max(1, _CHUNK_ELEMENTS // max(i, 1))
    for start in range(0, u, step):
        block, tgt = s[start : start + step], t[start : start + step]  # [c, i], [c]
        own = block.gather(1, tgt.unsqueeze(1))  # [c, 1]
        ahead = (block > own) | ((block == own) & (item < tgt.unsqueeze(1)))  # [c, i]
        ranks[start : start + step] = ahead.sum(dim=1) + 1
    return ranks.cpu().numpy()


def recall_ndcg_at_k(
    scores: torch.Tensor | np.ndarray, targets: Sequence[int] | np.ndarray, k: int
) -> dict[str, float]:
    """Full-catalog ``recall@k`` and ``ndcg@k`` (keys named with k) averaged over users."""
    ranks = target_ranks(scores, targets)
    return {
        f"recall@{k}": float(recall_at_k(ranks, k).mean()),
        f"ndcg@{k}": float(ndcg_at_k(ranks, k).mean()),
    }


# ---- reasoning quality without an LLM judge ----------------------------------------------------------
#
# An answer is `{"explanation": "...", "recommendations": [...]}`
# (docs/architecture.md#items-candidates-and-prompts). From its text and the prompt alone, per answer:
#   explanation      the JSON string value of the answer's leading "explanation" key, read even when the
#                    rest of the answer is broken; absent when the answer does not start with that key.
#   cited SID        a maximal run of SID tokens (`<a_12><b_7><c_201><d_3>`) in the explanation. A run that
#                    is not exactly one SID of the prompt (a truncated SID, two glued together, an
#                    invented one) is a citation of something the prompt does not hold.
#   grounded         the explanation cites at least one SID, and every SID it cites is in the prompt
#                    (the user's history or the candidates). No explanation or no citation: not grounded.
#   stated top pick  the first cited SID that is one of the request's candidates. The teacher's trace
#                    cites the history first, then its best candidates best first, then "Pick <best>",
#                    so on teacher text this is the top of the teacher's ranking (traces.write_trace).
#   pick agrees      the stated top pick is the first item of the served ranking; no pick: disagrees.
#   explanation tokens  length of the explanation in the model's tokens (0 when there is none).

REASONING_METRICS = (
    "explanation_rate",
    "cites_rate",
    "grounded_rate",
    "pick_agreement",
    "explanation_tokens",
)
_SID_RUN = re.compile(r"(?:<[a-z]_\d+>)+")  # consecutive SID tokens; `<|im_end|>` and the like never match
_EXPLANATION = re.compile(r'\A\s*\{\s*"explanation"\s*:\s*"((?:[^"\\]|\\.)*)"', re.DOTALL)


@dataclass(frozen=True)
class PromptContext:
    """What one request's prompt shows: every SID in it, and its candidates as (item id -> SID)."""

    sids: frozenset[str]  # history and candidate SIDs, as written in the prompt
    candidate_sid: Mapping[int, str]  # candidate item id -> its SID


def prompt_contexts(
    requests: pd.DataFrame, prompt_text: Callable[[Sequence[int]], str]
) -> dict[tuple[str, int, int], PromptContext]:
    """`request_key` -> what that request's prompt shows; `prompt_text` turns prompt ids into text
    with the SID tokens kept (`tokenizer.decode`)."""
    out = {}
    for req in _rows(requests):
        shown = frozenset(cited_sids(prompt_text([int(t) for t in req["prompt_ids"]])))
        sid_of = {int(i): str(s) for i, s in zip(req["candidates"], req["candidate_sids"], strict=True)}
        out[request_key(req)] = PromptContext(shown, sid_of)
    return out


def explanation_of(output_text: str | None) -> str | None:
    """The explanation string of an answer (JSON-unescaped), or None when the answer has none."""
    match = _EXPLANATION.match(output_text or "")
    if match is None:
        return None
    try:
        return json.loads(f'"{match.group(1)}"')
    except ValueError:  # an escape the model broke (`\u12`): no readable explanation
        return None


def cited_sids(text: str) -> list[str]:
    """Every SID-token run in `text`, in order (repeats kept)."""
    return _SID_RUN.findall(text)


def cites_only(explanation: str, shown: Collection[str]) -> bool:
    """Whether every SID `explanation` cites is one of `shown` (true when it cites none)."""
    return all(sid in shown for sid in cited_sids(explanation))


def stated_top_pick(explanation: str, candidates: Iterable[str]) -> str | None:
    """The first SID cited in `explanation` that is one of `candidates`; None when none is cited."""
    allowed = set(candidates)
    return next((sid for sid in cited_sids(explanation) if sid in allowed), None)


def reasoning_values(
    frame: pd.DataFrame | Iterable[Mapping[str, Any]],
    contexts: Mapping[tuple[str, int, int], PromptContext],
    count_tokens: Callable[[str], int],
) -> dict[str, np.ndarray]:
    """Per-answer value of every name in :data:`REASONING_METRICS` (each [u]; definitions above).

    Rows need `split`, `user_id`, `point`, `output_text` and `ranking` (item ids as served);
    `contexts` maps each `request_key` to that request's prompt.
    """
    out: dict[str, list[float]] = {name: [] for name in REASONING_METRICS}
    for row in _rows(frame):
        context = contexts[request_key(row)]
        explanation = explanation_of(row["output_text"])
        cited = cited_sids(explanation or "")
        pick = stated_top_pick(explanation or "", context.candidate_sid.values())
        served = _final_ranking(row)
        first = None if served is None or len(served) == 0 else context.candidate_sid.get(int(served[0]))
        out["explanation_rate"].append(float(explanation is not None))
        out["cites_rate"].append(float(bool(cited)))
        out["grounded_rate"].append(float(bool(cited) and cites_only(explanation or "", context.sids)))
        out["pick_agreement"].append(float(pick is not None and pick == first))
        out["explanation_tokens"].append(float(count_tokens(explanation)) if explanation else 0.0)
    return {name: np.asarray(values, dtype=np.float64) for name, values in out.items()}


def reasoning_metrics(
    rankings: pd.DataFrame,
    contexts: Mapping[tuple[str, int, int], PromptContext],
    count_tokens: Callable[[str], int],
    n_boot: int = 1000,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One row per (split, system, tau, window) that wrote text: `n`, the means of
    :data:`REASONING_METRICS` and `ci` (95% bootstrap over users), in frame order.

    The pre-rank decodes nothing and is left out.
    """
    frame = rankings[rankings["nfe"] > 0]  # decoded by a model (an empty answer still took a forward)
    rows = []
    keys = ["split", "system", "tau", "window"]
    for (split, system, tau, window), group in frame.groupby(keys, sort=False, dropna=False):
        values = reasoning_values(group, contexts, count_tokens)
        head = {
            "split": str(split),
            "system": str(system),
            "tau": None if pd.isna(tau) else float(tau),
            "window": None if pd.isna(window) else int(window),
            "n": len(group),
        }
        means = {k: float(v.mean()) for k, v in values.items()}
        users = group["user_id"].to_numpy() if "user_id" in group else None
        rows.append(head | means | {"ci": bootstrap_ci(values, n_boot, seed, groups=users)})
    return rows
