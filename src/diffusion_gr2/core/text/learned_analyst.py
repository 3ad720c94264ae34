"""The learned analyst: a teacher whose weights are fit on training requests, not set by hand.

A logistic ranker over the evidence of each candidate (`core/text/evidence.py`): each signal
standardised, its rank among the request's candidates, and the list position (one-hot). The ranks let
a linear model read "the best fit of these ten" as well as "a good fit". It is fit on the training
requests (is this candidate the target?), its regularisation is chosen on validation R@1, and its
noiseless R@1 is the teacher's ceiling: a model trained on its traces can at best learn what it knows.
It proposes like the rule-based analyst (its scores plus seeded Gumbel noise, so rejection sampling
draws from its own belief), and its trace cites the evidence that decided the pick: the levels the
prompt shows where it shows them, else the signals by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from sklearn.linear_model import LogisticRegression

from diffusion_gr2.core.text.evidence import SIGNAL_WORDS, SIGNALS, Evidence, LinearRanker, ranker_design
from diffusion_gr2.core.text.prompt import ItemLookup, PromptConfig, visible_history
from diffusion_gr2.core.text.traces import TAIL_ORDERS, RerankExample, noisy_order, write_trace


@dataclass(frozen=True)
class LearnedAnalystConfig:
    """conf: `traces.learned_analyst`."""

    cs: tuple[float, ...] = (0.01, 0.1, 1.0)  # inverse regularisation strengths tried on validation
    temperature: float = 0.0  # Gumbel noise on the logits when it proposes (0: its best candidate)
    # order after the pick: "prerank" (the retriever's), "score" (its own) or "noisy" (AnalystConfig)
    tail: str = "prerank"
    recency_decay: float = 0.8  # of the trace's history summary (as the rule-based analyst's)

    def __post_init__(self) -> None:
        if self.tail not in TAIL_ORDERS:
            raise ValueError(f"traces.learned_analyst.tail must be one of {TAIL_ORDERS}, got {self.tail!r}")
        if not self.cs or min(self.cs) <= 0:
            raise ValueError(f"traces.learned_analyst.cs must be positive values, got {self.cs}")


class LearnedAnalyst:
    """Teacher over the evidence and list position (the `Teacher` protocol of `traces`); its
    `evidence` carries its ranker, so prompts built from it can show the hint."""

    def __init__(
        self,
        evidence: Evidence,
        lookup: ItemLookup,
        config: LearnedAnalystConfig = LearnedAnalystConfig(),  # noqa: B008 (frozen)
        prompt_config: PromptConfig = PromptConfig(),  # noqa: B008
    ) -> None:
        if evidence.ranker is None:
            raise ValueError("a learned analyst needs evidence with a fit ranker (fit_learned_analyst)")
        self.evidence, self.ranker, self.lookup = evidence, evidence.ranker, lookup
        self.config, self.prompt_config = config, prompt_config
        self._last: tuple[RerankExample, np.ndarray] | None = None

    def _raw(self, example: RerankExample) -> np.ndarray:
        """The example's signals, counted once for the proposals rejection sampling makes in a row."""
        if self._last is None or self._last[0] != example:
            raw = self.evidence.table.raw(example.user_id, example.history, example.candidates)
            self._last = (example, raw)
        return self._last[1]

    def scores(self, example: RerankExample) -> np.ndarray:
        """[n] noiseless logits of the candidates, in pre-rank order."""
        return self.ranker.scores(self._raw(example))

    def _reason(self, example: RerankExample, pick: int) -> str:
        """The two signals that lift the pick most above the other candidates, as the prompt shows
        them (`co 4, fit 3` with levels, `watched with the history` with the hint only); the list
        position where no signal does."""
        raw = self._raw(example)
        x = self.ranker.design(raw)
        coef, s = np.asarray(self.ranker.coef), len(SIGNALS)
        part = x[:, :s] * coef[:s] + x[:, s : 2 * s] * coef[s : 2 * s]  # [n, signals] contributions
        lift = part[pick] - part.mean(axis=0)
        cited = [j for j in np.argsort(-lift, kind="stable")[:2] if lift[j] > 0]
        if not cited:
            return f"listed {pick + 1} of {len(raw)}, no stronger evidence"
        if self.evidence.table.config.in_prompt:
            levels = self.evidence.scale.levels(raw)
            return ", ".join(f"{SIGNALS[j]} {levels[pick, j]}" for j in cited)
        return ", ".join(SIGNAL_WORDS[SIGNALS[j]] for j in cited)

    def propose(self, example: RerankExample, rng: np.random.Generator) -> tuple[str, list[int]]:
        """One noisy ranking (item ids, best first) and the trace that explains its top pick."""
        order = noisy_order(self.scores(example), self.config.temperature, self.config.tail, rng)
        ranking = [example.candidates[j] for j in order]
        history = [self.lookup[i] for i in visible_history(example.history, self.prompt_config)]
        ranked = [self.lookup[i] for i in ranking]
        reason = self._reason(example, int(order[0]))
        return write_trace(history, ranked, reason, self.config.recency_decay), ranking


def _raws(evidence: Evidence, examples: Sequence[RerankExample]) -> list[np.ndarray]:
    """Per request, its candidates' raw signals: counted once, scored by every C."""
    return [evidence.table.raw(e.user_id, e.history, e.candidates) for e in examples]


def top_hits(analyst: LearnedAnalyst, examples: Sequence[RerankExample]) -> np.ndarray:
    """[r] 1.0 where the analyst's noiseless first pick is the request's target."""
    picks = [int(np.argmax(analyst.scores(e))) for e in examples]
    return np.array([float(e.candidates[k] == e.target) for k, e in zip(picks, examples, strict=True)])


def fit_learned_analyst(
    evidence: Evidence,
    lookup: ItemLookup,
    train: Sequence[RerankExample],
    valid: Sequence[RerankExample],
    config: LearnedAnalystConfig = LearnedAnalystConfig(),  # noqa: B008
    prompt_config: PromptConfig = PromptConfig(),  # noqa: B008
) -> tuple[LearnedAnalyst, dict[float, float]]:
    """The analyst fit on `train` at the C with the best validation R@1 (the smaller C on a tie), and
    every C's validation R@1. Requests whose target is not a candidate are left out of both."""
    train = [e for e in train if e.target in e.candidates]
    valid = [e for e in valid if e.target in e.candidates]
    if not train:
        raise ValueError("the learned analyst needs training requests whose target is a candidate")
    raws = _raws(evidence, train)
    stacked = np.vstack(raws)
    mean, std = stacked.mean(axis=0), stacked.std(axis=0) + 1e-9
    positions = max(len(e.candidates) for e in train)
    x = np.vstack([ranker_design(r, mean, std, positions) for r in raws])
    y = np.asarray([c == e.target for e in train for c in e.candidates])
    valid_x = [ranker_design(r, mean, std, positions) for r in _raws(evidence, valid)]
    by_c: dict[float, float] = {}
    best: tuple[float, LearnedAnalyst] | None = None
    for c in sorted(config.cs):
        fit = LogisticRegression(C=c, max_iter=3000).fit(x, y)
        ranker = LinearRanker(
            tuple(mean), tuple(std), tuple(fit.coef_[0]), float(fit.intercept_[0]), positions
        )
        picks = [int(np.argmax(xv @ fit.coef_[0])) for xv in valid_x]
        hits = [float(e.candidates[k] == e.target) for k, e in zip(picks, valid, strict=True)]
        by_c[c] = float(np.mean(hits)) if hits else float("nan")
        if best is None or by_c[c] > by_c[best[0]]:
            best = (c, LearnedAnalyst(replace(evidence, ranker=ranker), lookup, config, prompt_config))
    assert best is not None
    return best[1], by_c
