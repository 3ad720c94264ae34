"""Reasoning traces: a pluggable teacher, rejection sampling, and SFT rows
(docs/architecture.md#items-candidates-and-prompts).

The rule-based analyst here ranks candidates from features visible in the prompt (shared categories
with the recency-weighted history, brand, recency, popularity, list position) plus seeded Gumbel noise,
and writes GR2's three-step trace (history patterns, category matching, final selection) citing SIDs;
where the prompt shows evidence, the learned analyst (core/text/learned_analyst.py) writes the traces.
Rejection sampling keeps a trace only when the answer ranks the target within `keep_within`: 1 is
GR2's rule, the top pick is the target (it beats answer-given "targeted" traces); the default run
keeps every answer of its noiseless learned analyst (`traces.keep_within: 10`).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from diffusion_gr2.core.text.evidence import Evidence
from diffusion_gr2.core.text.prompt import (
    ItemInfo,
    ItemLookup,
    PromptConfig,
    PromptEvidence,
    build_messages,
    render_answer,
    visible_history,
)

log = logging.getLogger(__name__)

FEATURES = ("category", "brand", "recency", "popularity", "position")
_REASONS = {  # the step-3 phrase for the feature that contributes most to the pick's score
    "category": "best category fit with the history",
    "brand": "same brand as earlier items",
    "recency": "fits the most recent items",
    "popularity": "popular and on-topic",
    "position": "strong candidate listed early",
}


@dataclass(frozen=True)
class RerankExample:
    """One re-ranking request with its answer; teachers must not look at `target`."""

    user_id: int
    split: str
    history: tuple[int, ...]  # chronological, most recent last
    candidates: tuple[int, ...]  # pre-rank order
    target: int


def examples_from_frame(candidates: pd.DataFrame) -> list[RerankExample]:
    """Rows of the `candidates` frame (docs/architecture.md) as examples."""
    return [
        RerankExample(
            user_id=int(r.user_id),
            split=str(r.split),
            history=tuple(int(i) for i in r.history),
            candidates=tuple(int(i) for i in r.candidates),
            target=int(r.target),
        )
        for r in candidates.itertuples(index=False)
    ]


class Teacher(Protocol):
    """Proposes an explanation and a full ranking (item ids, best first) for one example."""

    def propose(self, example: RerankExample, rng: np.random.Generator) -> tuple[str, list[int]]: ...


TAIL_ORDERS = ("prerank", "score", "noisy")


@dataclass(frozen=True)
class AnalystConfig:
    """Feature weights and noise of the rule-based analyst."""

    recency_decay: float = 0.8  # weight of the k-th most recent history item is decay**k
    w_category: float = 1.0  # shared categories are the main signal on MovieLens and Amazon
    w_brand: float = 0.5  # a repeat brand is a strong signal where brands exist (Amazon)
    w_recency: float = 0.5  # a category shared with the latest items matters more than an old one
    w_popularity: float = 0.3  # popular items are likelier a priori
    w_position: float = 2.5  # the pre-rank order is visible and informative (pre-rank R@1 ~ .28)
    temperature: float = 0.3  # scale of the Gumbel noise: repeated proposals differ
    # Order of the candidates after the top pick: "prerank" keeps the retriever's order (the answer
    # is then "promote one item", the simplest full permutation to copy; a noisy tail is label
    # noise the model cannot predict), "score" sorts them by the noiseless score, "noisy" by the
    # same noisy draw as the top pick (the papers' free re-ranking; needs a model that copies well).
    tail: str = "prerank"

    def __post_init__(self) -> None:
        if self.tail not in TAIL_ORDERS:
            raise ValueError(f"analyst tail must be one of {TAIL_ORDERS}, got {self.tail!r}")

    def weights(self) -> np.ndarray:
        """[5] weights in the order of FEATURES."""
        return np.array([self.w_category, self.w_brand, self.w_recency, self.w_popularity, self.w_position])


def noisy_order(base: np.ndarray, temperature: float, tail: str, rng: np.random.Generator) -> np.ndarray:
    """A teacher's proposal: candidate indices, the pick drawn from `base` scores plus Gumbel noise
    of scale `temperature`, then the rest in `tail` order (`TAIL_ORDERS`)."""
    order = np.argsort(-(base + temperature * rng.gumbel(size=base.shape)), kind="stable")
    if tail != "noisy":
        rest = range(len(base)) if tail == "prerank" else np.argsort(-base, kind="stable")
        order = np.array([order[0], *(j for j in rest if j != order[0])])
    return order


def history_weights(m: int, decay: float) -> np.ndarray:
    """[m] recency weights for a history of m items, oldest first (the latest item weighs 1)."""
    return decay ** np.arange(m - 1, -1, -1, dtype=np.float64)


def candidate_features(
    history: Sequence[ItemInfo], candidates: Sequence[ItemInfo], popularity: Sequence[float], decay: float
) -> np.ndarray:
    """[n, 5] features in [0, 1] per candidate, in the order of FEATURES.

    category: recency-weighted share of the candidate's categories found on each history item;
    brand: recency-weighted share of history items with the same (non-empty) brand;
    recency: weight of the latest history item sharing a category; popularity: log-popularity relative
    to the most popular candidate; position: 1 for the first listed candidate down to 1/n.
    """
    w = history_weights(len(history), decay)
    total = max(float(w.sum()), 1e-12)
    n = len(candidates)
    pop = np.log1p(np.asarray(popularity, dtype=np.float64))
    feats = np.zeros((n, len(FEATURES)))
    for c, cand in enumerate(candidates):
        cats = set(cand.categories)
        shared = np.array([len(cats & set(h.categories)) / max(len(cats), 1) for h in history])
        same_brand = np.array([bool(cand.brand) and cand.brand == h.brand for h in history], dtype=float)
        feats[c, 0] = float((w * shared).sum()) / total
        feats[c, 1] = float((w * same_brand).sum()) / total
        feats[c, 2] = float(w[shared > 0].max()) if (shared > 0).any() else 0.0
    feats[:, 3] = pop / pop.max() if n and pop.max() > 0 else 0.0
    feats[:, 4] = (n - np.arange(n)) / max(n, 1)
    return feats


def dominant_categories(history: Sequence[ItemInfo], decay: float, k: int = 2) -> list[str]:
    """The k categories with the largest recency-weighted count in the history."""
    counts: Counter[str] = Counter()
    for weight, item in zip(history_weights(len(history), decay), history, strict=True):
        for cat in item.categories:
            counts[cat] += float(weight)
    return [c for c, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k]]


def _match_phrase(cand: ItemInfo, history: Sequence[ItemInfo], top_cats: Sequence[str]) -> str:
    """Step-2 clause for one candidate: which history categories or brand it shares."""
    seen = {c for h in history for c in h.categories}
    shared = [c for c in cand.categories if c in seen]
    shared.sort(key=lambda c: (c not in top_cats, cand.categories.index(c)))  # dominant ones first
    if cand.brand and any(cand.brand == h.brand for h in history):
        shared.append(f"brand {cand.brand}")
    return f"{cand.sid} shares {', '.join(shared)}" if shared else f"{cand.sid} has little overlap"


def write_trace(
    history: Sequence[ItemInfo], ranked: Sequence[ItemInfo], pick_reason: str, decay: float
) -> str:
    """The three-step trace (GR2): history patterns, category matching, final selection."""
    top_cats = dominant_categories(history, decay)
    pattern = f"mostly {', '.join(top_cats)}" if top_cats else "varied items"
    latest = history[-1] if history else None
    step1 = f"1) History: {pattern}" + (f"; latest {latest.sid} {latest.title}." if latest else ".")
    step2 = "2) " + "; ".join(_match_phrase(c, history, top_cats) for c in ranked[:2]) + "."
    step3 = f"3) Pick {ranked[0].sid} {ranked[0].title}: {pick_reason}."
    return " ".join([step1, step2, step3])


class RuleBasedAnalyst:
    """Default teacher: feature scores + Gumbel noise, and a templated three-step trace.

    Holds the item lookup and popularity table (read-only state shared by every proposal).
    """

    def __init__(
        self,
        lookup: ItemLookup,
        popularity: Mapping[int, float] | None = None,
        config: AnalystConfig = AnalystConfig(),  # noqa: B008 (frozen, safe as a default)
        prompt_config: PromptConfig = PromptConfig(),  # noqa: B008
    ) -> None:
        self.lookup = lookup
        self.popularity = dict(popularity or {})
        self.config = config
        self.prompt_config = prompt_config

    def scores(self, example: RerankExample) -> tuple[np.ndarray, np.ndarray]:
        """([n, 5] features, [n] noiseless scores) of the candidates, from what the prompt shows."""
        history = [self.lookup[i] for i in visible_history(example.history, self.prompt_config)]
        cands = [self.lookup[i] for i in example.candidates]
        pop = [self.popularity.get(i, 0.0) for i in example.candidates]
        feats = candidate_features(history, cands, pop, self.config.recency_decay)
        return feats, feats @ self.config.weights()

    def propose(self, example: RerankExample, rng: np.random.Generator) -> tuple[str, list[int]]:
        """One noisy ranking (item ids, best first) and the trace that explains its top pick."""
        feats, base = self.scores(example)
        order = noisy_order(base, self.config.temperature, self.config.tail, rng)
        ranking = [example.candidates[j] for j in order]
        contrib = feats[order[0]] * self.config.weights()
        reason = _REASONS[FEATURES[int(np.argmax(contrib))]]
        history = [self.lookup[i] for i in visible_history(example.history, self.prompt_config)]
        trace = write_trace(history, [self.lookup[i] for i in ranking], reason, self.config.recency_decay)
        return trace, ranking


def popularity_from_histories(histories: Iterable[Sequence[int]]) -> dict[int, float]:
    """Interaction counts per item over `histories` (use training data only: no test leakage)."""
    counts: Counter[int] = Counter()
    for history in histories:
        counts.update(int(i) for i in history)
    return {i: float(n) for i, n in counts.items()}


@dataclass(frozen=True)
class TraceRow:
    """An accepted trace: the teacher's explanation and ranking (item ids), and the tries it took."""

    example: RerankExample
    explanation: str
    ranking: tuple[int, ...]
    tries: int


@dataclass(frozen=True)
class RejectionStats:
    """Outcome of rejection sampling; rates are over the eligible examples."""

    examples: int  # all examples seen
    eligible: int  # examples that can be accepted: their target is a candidate (keep_within None: all)
    accepted: int
    acceptance_rate: float  # accepted / eligible
    mean_tries: float  # proposals per eligible example (a rejected one used max_tries)
    mean_tries_accepted: float  # proposals per accepted example
    tries_histogram: dict[int, int] = field(default_factory=dict)  # tries -> accepted examples


def _is_permutation(ranking: Sequence[int], candidates: Sequence[int]) -> bool:
    return len(ranking) == len(candidates) and sorted(ranking) == sorted(candidates)


def _accepts(ranking: Sequence[int], target: int, keep_within: int | None) -> bool:
    """Whether an answer is kept: the target within its first `keep_within` (None: every answer)."""
    return keep_within is None or target in ranking[:keep_within]


def _sample_one(
    teacher: Teacher,
    example: RerankExample,
    rng: np.random.Generator,
    max_tries: int,
    keep_within: int | None = 1,
) -> tuple[TraceRow | None, int]:
    """Propose until the answer is accepted (`_accepts`); returns (row or None, tries used)."""
    for tries in range(1, max_tries + 1):
        explanation, ranking = teacher.propose(example, rng)
        if not _is_permutation(ranking, example.candidates):
            log.warning("teacher returned a ranking that is not a permutation (user %d)", example.user_id)
            continue
        if _accepts(ranking, example.target, keep_within):
            return TraceRow(example, explanation, tuple(int(i) for i in ranking), tries), tries
    return None, max_tries


def rejection_sample(
    teacher: Teacher,
    examples: Sequence[RerankExample],
    max_tries: int = 8,
    seed: int = 0,
    keep_within: int | None = 1,
) -> tuple[list[TraceRow], RejectionStats]:
    """Keep one trace per example whose answer ranks the target within its first `keep_within` (1:
    the top pick is the target, GR2's rule), within `max_tries` proposals. `keep_within=None` keeps
    the first proposal of every example, its target a candidate or not: a teacher without noise
    proposes one answer, and rejection only chooses which requests it teaches.

    Each example gets its own generator seeded by (seed, index), so results do not depend on how the
    examples are batched or on the other examples.
    """
    rows: list[TraceRow] = []
    tries_used: list[int] = []
    for index, example in enumerate(tqdm(examples, desc="traces", disable=None)):
        if keep_within is not None and example.target not in example.candidates:
            continue
        rng = np.random.default_rng([seed, index])
        row, tries = _sample_one(teacher, example, rng, max_tries, keep_within)
        tries_used.append(tries)
        if row is not None:
            rows.append(row)
    stats = _stats(len(examples), tries_used, rows)
    log.info("rejection sampling: %s", stats)
    return rows, stats


def _stats(n_examples: int, tries_used: Sequence[int], rows: Sequence[TraceRow]) -> RejectionStats:
    eligible = len(tries_used)
    histogram = Counter(r.tries for r in rows)
    return RejectionStats(
        examples=n_examples,
        eligible=eligible,
        accepted=len(rows),
        acceptance_rate=len(rows) / eligible if eligible else math.nan,
        mean_tries=float(np.mean(tries_used)) if eligible else math.nan,
        mean_tries_accepted=float(np.mean([r.tries for r in rows])) if rows else math.nan,
        tries_histogram=dict(sorted(histogram.items())),
    )


@dataclass(frozen=True)
class SFTRow:
    """One supervised example: chat messages (system + user) and the assistant's answer text."""

    user_id: int
    split: str
    target: int
    messages: list[dict[str, str]]
    response_text: str


def build_sft_rows(
    rows: Iterable[TraceRow], lookup: ItemLookup, config: PromptConfig, evidence: Evidence | None = None
) -> list[SFTRow]:
    """Accepted traces as (messages, JSON answer) pairs for SFT (prompts with `evidence` where given)."""

    def shown(e: RerankExample) -> PromptEvidence | None:
        return None if evidence is None else evidence.for_prompt(e.user_id, e.history, e.candidates)

    return [
        SFTRow(
            user_id=r.example.user_id,
            split=r.example.split,
            target=r.example.target,
            messages=build_messages(
                r.example.history, r.example.candidates, lookup, config, shown(r.example)
            ),
            response_text=render_answer(r.explanation, lookup.sids(r.ranking)),
        )
        for r in rows
    ]


def sft_frame(rows: Sequence[SFTRow]) -> pd.DataFrame:
    """SFT rows as a frame (`user_id, split, target, system, user, response_text`) for parquet."""
    return pd.DataFrame(
        {
            "user_id": [r.user_id for r in rows],
            "split": [r.split for r in rows],
            "target": [r.target for r in rows],
            "system": [r.messages[0]["content"] for r in rows],
            "user": [r.messages[1]["content"] for r in rows],
            "response_text": [r.response_text for r in rows],
        }
    )


def corpus_texts(rows: Iterable[SFTRow]) -> list[str]:
    """Every message and answer text of `rows`: the corpus `build_tokenizer` trains on."""
    return [text for r in rows for text in (*(m["content"] for m in r.messages), r.response_text)]


def sft_rows_from_frame(frame: pd.DataFrame) -> list[SFTRow]:
    """Inverse of `sft_frame`."""
    return [
        SFTRow(
            user_id=int(r.user_id),
            split=str(r.split),
            target=int(r.target),
            messages=[{"role": "system", "content": r.system}, {"role": "user", "content": r.user}],
            response_text=str(r.response_text),
        )
        for r in frame.itertuples(index=False)
    ]
