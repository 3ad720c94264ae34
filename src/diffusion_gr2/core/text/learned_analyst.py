"""The learned analyst: a teacher whose weights are fit on training requests, not set by hand.

A logistic ranker over what the prompt shows of each candidate: the levels of its evidence
(`core/text/evidence.py`, one-hot per signal) and its list position (one-hot). It is fit on the
training requests (is this candidate the target?), its regularisation is chosen on validation R@1, and
its noiseless R@1 is the teacher's ceiling: a model trained on its traces can at best learn what it
knows. It proposes like the rule-based analyst (its scores plus seeded Gumbel noise, so rejection
sampling draws from its own belief) and its trace cites the evidence levels that decided the pick,
each a figure the prompt shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sklearn.linear_model import LogisticRegression

from diffusion_gr2.core.text.evidence import SIGNALS, Evidence
from diffusion_gr2.core.text.prompt import ItemLookup, PromptConfig, visible_history
from diffusion_gr2.core.text.traces import TAIL_ORDERS, RerankExample, noisy_order, write_trace


@dataclass(frozen=True)
class LearnedAnalystConfig:
    """conf: `traces.learned_analyst`."""

    cs: tuple[float, ...] = (0.01, 0.1, 1.0)  # inverse regularisation strengths tried on validation
    temperature: float = 1.0  # Gumbel noise on the logits: 1 samples from the ranker's own softmax
    # order after the pick: "prerank" (the retriever's), "score" (its own) or "noisy" (AnalystConfig)
    tail: str = "prerank"
    recency_decay: float = 0.8  # of the trace's history summary (as the rule-based analyst's)

    def __post_init__(self) -> None:
        if self.tail not in TAIL_ORDERS:
            raise ValueError(f"traces.learned_analyst.tail must be one of {TAIL_ORDERS}, got {self.tail!r}")
        if not self.cs or min(self.cs) <= 0:
            raise ValueError(f"traces.learned_analyst.cs must be positive values, got {self.cs}")


def design(levels: np.ndarray, n_levels: int) -> np.ndarray:
    """[n, signals x n_levels + n] one-hot evidence levels and one-hot list position of one request."""
    n = len(levels)
    onehots = [np.eye(n_levels)[levels[:, j]] for j in range(levels.shape[1])]
    return np.hstack([*onehots, np.eye(n)])


class LearnedAnalyst:
    """Teacher over the prompt's evidence and list position (the `Teacher` protocol of `traces`)."""

    def __init__(
        self,
        evidence: Evidence,
        lookup: ItemLookup,
        ranker: LogisticRegression,
        config: LearnedAnalystConfig = LearnedAnalystConfig(),  # noqa: B008 (frozen)
        prompt_config: PromptConfig = PromptConfig(),  # noqa: B008
    ) -> None:
        self.evidence, self.lookup, self.ranker = evidence, lookup, ranker
        self.config, self.prompt_config = config, prompt_config

    def levels(self, example: RerankExample) -> np.ndarray:
        return self.evidence.levels(example.user_id, example.history, example.candidates)

    def scores(self, example: RerankExample) -> np.ndarray:
        """[n] noiseless logits of the candidates, in pre-rank order."""
        return self.ranker.decision_function(design(self.levels(example), self.evidence.table.config.levels))

    def _reason(self, levels: np.ndarray, pick: int) -> str:
        """The evidence that lifts the pick most above the other candidates, cited as the prompt shows
        it (`after 4, fit 3`); the list position where no evidence does."""
        n_levels = self.evidence.table.config.levels
        coef = self.ranker.coef_[0][: len(SIGNALS) * n_levels].reshape(len(SIGNALS), n_levels)
        lift = np.array(
            [coef[j, levels[pick, j]] - coef[j, levels[:, j]].mean() for j in range(len(SIGNALS))]
        )
        cited = [j for j in np.argsort(-lift, kind="stable")[:2] if lift[j] > 0]
        if not cited:
            return f"listed {pick + 1} of {len(levels)}, no stronger evidence"
        return ", ".join(f"{SIGNALS[j]} {levels[pick, j]}" for j in cited)

    def propose(self, example: RerankExample, rng: np.random.Generator) -> tuple[str, list[int]]:
        """One noisy ranking (item ids, best first) and the trace that explains its top pick."""
        levels = self.levels(example)
        base = self.ranker.decision_function(design(levels, self.evidence.table.config.levels))
        order = noisy_order(base, self.config.temperature, self.config.tail, rng)
        ranking = [example.candidates[j] for j in order]
        history = [self.lookup[i] for i in visible_history(example.history, self.prompt_config)]
        ranked = [self.lookup[i] for i in ranking]
        return write_trace(
            history, ranked, self._reason(levels, int(order[0])), self.config.recency_decay
        ), ranking


def _designs(evidence: Evidence, examples: Sequence[RerankExample]) -> list[np.ndarray]:
    """Per request, its candidates' design rows (`design`): counted once, scored by every C."""
    n_levels = evidence.table.config.levels
    return [design(evidence.levels(e.user_id, e.history, e.candidates), n_levels) for e in examples]


def _hits(
    ranker: LogisticRegression, designs: Sequence[np.ndarray], examples: Sequence[RerankExample]
) -> np.ndarray:
    """[r] 1.0 where the ranker's noiseless first pick is the request's target."""
    picks = [int(np.argmax(ranker.decision_function(x))) for x in designs]
    return np.array([float(e.candidates[k] == e.target) for k, e in zip(picks, examples, strict=True)])


def top_hits(analyst: LearnedAnalyst, examples: Sequence[RerankExample]) -> np.ndarray:
    """[r] 1.0 where the analyst's noiseless first pick is the request's target."""
    return _hits(analyst.ranker, _designs(analyst.evidence, examples), examples)


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
    x = np.vstack(_designs(evidence, train))
    y = np.asarray([c == e.target for e in train for c in e.candidates])
    valid_designs = _designs(evidence, valid)
    by_c: dict[float, float] = {}
    best: LearnedAnalyst | None = None
    for c in sorted(config.cs):
        ranker = LogisticRegression(C=c, max_iter=2000).fit(x, y)
        analyst = LearnedAnalyst(evidence, lookup, ranker, config, prompt_config)
        by_c[c] = float(_hits(ranker, valid_designs, valid).mean()) if valid else float("nan")
        if best is None or by_c[c] > by_c[best.ranker.C]:
            best = analyst
    assert best is not None
    return best, by_c
