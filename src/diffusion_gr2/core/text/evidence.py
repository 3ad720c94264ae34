"""Evidence the retriever does not use, counted on training sequences and shown in the prompt.

The first-stage retriever orders candidates from the item IDs of the user's recent history. A
re-ranker can beat that order only with evidence the retriever does not read, stated so a small model
can read it (docs/architecture.md#evidence-in-the-prompt). Per candidate:

* `fit`: how well its categories (genres on MovieLens) match the user's whole history, not only the
  few items the prompt lists: the mean share of history items carrying each of its categories;
* `year`: how close its release year is to the years the user watches (minus the distance in years
  to the history's median year); absent where the data has no years (Amazon: 0 for every candidate);
* `after`: how often it follows the user's recent items in *other* users' training sequences (within
  `window` positions), the requesting user's own sequence left out, so no request sees its own target;
* `pop`: its interactions in other users' training sequences (log scale);
* `co`: how often other users watched it together with the user's history items (item-to-item
  cosine of the users' sets, averaged over the history), the requesting user left out;
* `co_recent`: the same over the last `co_recent` history items, the latest weighing most.

The prompt can show the evidence two ways. `in_prompt`: each signal as a level 0..`levels`-1 on each
candidate's line, cut at quantiles of the training requests' candidates (`EvidenceScale`). `hint`: one
line naming the `hint` candidates the learned analyst (`core/text/learned_analyst.py`) scores highest,
best first (`LinearRanker`): a conclusion a small model can copy, where six digits per candidate are
a function it must learn (docs/experiments.md#a-ranked-hint-in-the-prompt).
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd
from scipy import sparse

from diffusion_gr2.core.text.prompt import PromptEvidence

SIGNALS = ("fit", "year", "after", "pop", "co", "co_recent")
# What a trace says of a signal where the prompt shows no level of it (a hint only).
SIGNAL_WORDS = {
    "fit": "genre fit with the history",
    "year": "release year",
    "after": "follows the latest items",
    "pop": "popular",
    "co": "watched with the history",
    "co_recent": "watched with the latest items",
}
_YEAR = re.compile(r"(?:release_year|year)\s*:\s*(\d{4})")


@dataclass(frozen=True)
class EvidenceConfig:
    """What the evidence counts and how finely the prompt shows it (conf: `traces.evidence`)."""

    # True: each candidate's line ends with its levels and the learned analyst writes the traces (a
    # registered version then carries the evidence, so it serves the same prompts). False: the prompt
    # shows titles and categories only, and the evidence still gives the learned analyst's ceiling
    # in the trace report.
    in_prompt: bool = False
    levels: int = 5  # each signal as a digit 0..levels-1
    recent: int = 3  # `after` counts the followers of the user's last `recent` items
    window: int = 3  # b follows a when it comes within `window` positions after a
    # The learned analyst's `hint` best candidates named on one line of the prompt (0: no line).
    hint: int = 3
    co_recent: int = 10  # `co_recent` reads the last 10 history items, weights 0.8**age
    co_decay: float = 0.8

    def __post_init__(self) -> None:
        if not 2 <= self.levels <= 10:
            raise ValueError(f"traces.evidence.levels must be in 2..10 (one digit), got {self.levels}")
        if self.recent < 1 or self.window < 1 or self.co_recent < 1:
            raise ValueError(f"traces.evidence.recent, window and co_recent must be >= 1, got {self}")
        if self.hint < 0 or not 0.0 < self.co_decay <= 1.0:
            raise ValueError(f"traces.evidence.hint must be >= 0 and co_decay in (0, 1], got {self}")

    @property
    def shown(self) -> bool:
        """Whether the prompt shows any evidence (levels or the hint)."""
        return self.in_prompt or self.hint > 0


def item_years(items: pd.DataFrame) -> dict[int, float]:
    """Release year per item, read from its description (`release_year: 1996`); NaN where absent."""
    years = {}
    for item_id, text in zip(items["item_id"], items["description"].fillna(""), strict=True):
        match = _YEAR.search(str(text))
        years[int(item_id)] = float(match.group(1)) if match else math.nan
    return years


def _follow_pairs(sequence: Sequence[int], window: int) -> Iterable[tuple[int, int]]:
    for i, a in enumerate(sequence):
        for b in sequence[i + 1 : i + 1 + window]:
            yield int(a), int(b)


class EvidenceTable:
    """Counts over every user's training sequence, and each user's own share of them to leave out."""

    def __init__(
        self,
        sequences: Mapping[int, Sequence[int]],
        categories: Mapping[int, Sequence[str]],
        years: Mapping[int, float],
        config: EvidenceConfig = EvidenceConfig(),  # noqa: B008 (frozen, safe as a default)
    ) -> None:
        self.config = config
        self.sequences = {int(u): [int(i) for i in s] for u, s in sequences.items()}
        self.categories = {int(i): tuple(c) for i, c in categories.items()}
        self.years = dict(years)
        self.popularity: Counter[int] = Counter(i for s in self.sequences.values() for i in s)
        self.follows: defaultdict[int, Counter[int]] = defaultdict(Counter)
        for seq in self.sequences.values():
            for a, b in _follow_pairs(seq, config.window):
                self.follows[a][b] += 1
        # users x items, 1 where the user's training sequence holds the item: co-watching counts
        self.columns = {i: k for k, i in enumerate(sorted({i for s in self.sequences.values() for i in s}))}
        self.rows = {u: k for k, u in enumerate(self.sequences)}
        pairs = [(self.rows[u], self.columns[i]) for u, s in self.sequences.items() for i in set(s)]
        r, c = (np.array(x, dtype=np.int64) for x in zip(*pairs, strict=True)) if pairs else ([], [])
        self.watched = sparse.csc_matrix(
            (np.ones(len(r), dtype=np.float32), (r, c)), shape=(len(self.rows), len(self.columns))
        )
        self.watchers = np.asarray(self.watched.sum(axis=0)).ravel()

    @classmethod
    def from_frames(
        cls,
        splits: pd.DataFrame,
        items: pd.DataFrame,
        config: EvidenceConfig = EvidenceConfig(),  # noqa: B008
    ) -> EvidenceTable:
        """From the `splits` frame's training sequences and the `items` frame (training data only)."""
        sequences = dict(zip(splits["user_id"], splits["train_items"], strict=True))
        categories = {
            int(i): [str(c) for c in (cs if cs is not None else [])]
            for i, cs in zip(items["item_id"], items["categories"], strict=True)
        }
        return cls(sequences, categories, item_years(items), config)

    def _own_follows(self, user_id: int, recent: set[int], candidates: set[int]) -> Counter[int]:
        """The user's own contribution to `after`: pairs (recent item, candidate) in their sequence."""
        own: Counter[int] = Counter()
        for a, b in _follow_pairs(self.sequences.get(user_id, []), self.config.window):
            if a in recent and b in candidates:
                own[b] += 1
        return own

    def _cowatched(self, user_id: int, history: Sequence[int], candidates: Sequence[int]) -> np.ndarray:
        """[n, 2] `co` and `co_recent`: cosine of the candidate's and each history item's watchers,
        the requesting user left out; an item no other user watched adds 0."""
        out = np.zeros((len(candidates), 2))
        recent = [int(i) for i in history][-self.config.co_recent :]
        h_cols = [self.columns[i] for i in dict.fromkeys(history) if i in self.columns]
        c_cols = [self.columns.get(int(c), -1) for c in candidates]
        known = [k for k, col in enumerate(c_cols) if col >= 0]
        if not h_cols or not known:
            return out
        own = np.zeros(len(self.columns))
        if user_id in self.rows:
            own = self.watched[self.rows[user_id]].toarray().ravel()
        cols = [c_cols[k] for k in known]
        both = (self.watched[:, h_cols].T @ self.watched[:, cols]).toarray()
        both -= own[h_cols][:, None] * own[cols][None, :]
        others = np.maximum(self.watchers - own, 1.0)
        cosine = both / np.sqrt(others[h_cols][:, None] * others[cols][None, :])
        out[known, 0] = cosine.mean(axis=0)
        row_of = {col: k for k, col in enumerate(h_cols)}
        ages = range(len(recent) - 1, -1, -1)
        weighted = [
            (self.config.co_decay**a, row_of[self.columns[i]])
            for a, i in zip(ages, recent, strict=True)
            if i in self.columns
        ]
        if weighted:
            w = np.array([x for x, _ in weighted])
            out[known, 1] = (w[:, None] * cosine[[k for _, k in weighted]]).sum(axis=0) / w.sum()
        return out

    def raw(self, user_id: int, history: Sequence[int], candidates: Sequence[int]) -> np.ndarray:
        """[n, signals] raw signals per candidate, in the order of `SIGNALS` (larger = more likely)."""
        history = [int(i) for i in history]
        recent = history[-self.config.recent :]
        own_items = Counter(self.sequences.get(user_id, []))
        own_after = self._own_follows(user_id, set(recent), {int(c) for c in candidates})
        share = Counter(c for i in history for c in set(self.categories.get(i, ())))
        years = [y for y in (self.years.get(i, math.nan) for i in history) if not math.isnan(y)]
        median_year = float(np.median(years)) if years else math.nan
        out = np.zeros((len(candidates), len(SIGNALS)))
        for k, c in enumerate(int(c) for c in candidates):
            cats = self.categories.get(c, ())
            out[k, 0] = float(np.mean([share[g] / len(history) for g in cats])) if cats and history else 0.0
            year = self.years.get(c, math.nan)
            out[k, 1] = 0.0 if math.isnan(year) or math.isnan(median_year) else -abs(year - median_year)
            after = sum(self.follows[a][c] for a in recent) - own_after[c]
            out[k, 2] = math.log1p(max(after, 0))
            out[k, 3] = math.log1p(max(self.popularity[c] - own_items[c], 0))
        out[:, 4:] = self._cowatched(int(user_id), history, candidates)
        return out


@dataclass(frozen=True)
class EvidenceScale:
    """Quantile cuts per signal: raw value -> level 0..levels-1, fit on training requests."""

    cuts: tuple[tuple[float, ...], ...]  # per signal, levels-1 ascending cut points

    @classmethod
    def fit(cls, raw: np.ndarray, levels: int) -> EvidenceScale:
        """Cuts at the quantiles of `raw` ([rows, signals]); a signal with ties keeps distinct cuts only."""
        qs = np.linspace(0, 1, levels + 1)[1:-1]
        return cls(tuple(tuple(np.unique(np.quantile(raw[:, j], qs))) for j in range(raw.shape[1])))

    def levels(self, raw: np.ndarray) -> np.ndarray:
        """[n, signals] integer levels of `raw`: how many cuts lie strictly below the value, so a value
        tied with a cut (the many zeros of a sparse count) stays in the lower level."""
        return (
            np.stack(
                [np.searchsorted(np.asarray(c), raw[:, j], side="left") for j, c in enumerate(self.cuts)],
                axis=1,
            ).astype(int)
            if raw.size
            else np.zeros((0, len(self.cuts)), dtype=int)
        )

    def to_dict(self) -> dict[str, list[float]]:
        return {name: list(c) for name, c in zip(SIGNALS, self.cuts, strict=True)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Sequence[float]]) -> EvidenceScale:
        return cls(tuple(tuple(float(x) for x in data[name]) for name in SIGNALS))


def evidence_text(levels: Sequence[int]) -> str:
    """One candidate's levels as the prompt shows them: `fit 3 year 2 after 4 pop 1`."""
    return " ".join(f"{name} {int(v)}" for name, v in zip(SIGNALS, levels, strict=True))


@dataclass(frozen=True)
class LinearRanker:
    """The learned analyst's scores as plain arrays, so a served version computes the hint without
    scikit-learn: per candidate, each signal standardised (`mean`, `std` of the training requests'
    candidates), its rank among the request's candidates (1 best .. 0 worst) and its list position
    (one-hot, positions past `positions` share the last)."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    coef: tuple[float, ...]  # len(SIGNALS) standardised, len(SIGNALS) ranks, then `positions`
    intercept: float
    positions: int

    def design(self, raw: np.ndarray) -> np.ndarray:
        """[n, 2 x signals + positions] features of one request's candidates."""
        return ranker_design(raw, np.asarray(self.mean), np.asarray(self.std), self.positions)

    def scores(self, raw: np.ndarray) -> np.ndarray:
        """[n] logits of one request's candidates."""
        return self.design(raw) @ np.asarray(self.coef) + self.intercept

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LinearRanker:
        return cls(
            tuple(data["mean"]),
            tuple(data["std"]),
            tuple(data["coef"]),
            float(data["intercept"]),
            int(data["positions"]),
        )


def within_ranks(raw: np.ndarray) -> np.ndarray:
    """[n, signals] each value's rank among the request's candidates: 1 the largest, 0 the smallest
    (ties share the better rank)."""
    n = len(raw)
    if n < 2:
        return np.ones_like(raw)
    below = (raw[None, :, :] < raw[:, None, :]).sum(axis=1)  # candidates each one beats
    return below / (n - 1)


def ranker_design(raw: np.ndarray, mean: np.ndarray, std: np.ndarray, positions: int) -> np.ndarray:
    """`LinearRanker.design`, from the arrays (the fit's own helper too)."""
    position = np.eye(positions)[np.minimum(np.arange(len(raw)), positions - 1)]
    return np.hstack([(raw - mean) / std, within_ranks(raw), position])


@dataclass(frozen=True)
class Evidence:
    """What the prompt states: the counts, the cuts that turn them into levels, and the learned
    analyst's ranker that names the hint (None until the analyst is fit)."""

    table: EvidenceTable
    scale: EvidenceScale
    ranker: LinearRanker | None = None

    @classmethod
    def fit(
        cls, table: EvidenceTable, requests: Iterable[tuple[int, Sequence[int], Sequence[int]]]
    ) -> Evidence:
        """Cuts at the quantiles of the signals of `requests` ((user, history, candidates): the
        training requests)."""
        raw = [table.raw(u, h, c) for u, h, c in requests]
        stacked = np.vstack(raw) if raw else np.zeros((0, len(SIGNALS)))
        return cls(table, EvidenceScale.fit(stacked, table.config.levels))

    def levels(self, user_id: int, history: Sequence[int], candidates: Sequence[int]) -> np.ndarray:
        """[n, signals] levels of one request's candidates."""
        return self.scale.levels(self.table.raw(user_id, history, candidates))

    def lines(self, user_id: int, history: Sequence[int], candidates: Sequence[int]) -> list[str]:
        """Per candidate, the text the prompt appends to its line."""
        return [evidence_text(row) for row in self.levels(user_id, history, candidates)]

    def order(self, raw: np.ndarray) -> list[int]:
        """Candidate indices by the learned analyst's noiseless scores of `raw` (`table.raw`), best
        first, the list position breaking ties."""
        if self.ranker is None:
            raise ValueError("the evidence's order needs the learned analyst's ranker; none was fit")
        return [int(k) for k in np.argsort(-self.ranker.scores(raw), kind="stable")]

    def favoured(self, user_id: int, history: Sequence[int], candidates: Sequence[int]) -> list[int]:
        """Indices of the `hint` candidates the ranker scores highest, best first."""
        return self.order(self.table.raw(user_id, history, candidates))[: self.table.config.hint]

    def for_prompt(
        self, user_id: int, history: Sequence[int], candidates: Sequence[int]
    ) -> PromptEvidence | None:
        """What one request's prompt shows of the evidence (None: nothing); its signals counted once."""
        config = self.table.config
        if not config.shown:
            return None
        raw = self.table.raw(user_id, history, candidates)
        lines = tuple(evidence_text(row) for row in self.scale.levels(raw)) if config.in_prompt else None
        return PromptEvidence(lines, tuple(self.order(raw)[: config.hint]))


def evidence_spec(evidence: Evidence) -> dict[str, Any]:
    """What a run saves of its evidence (`evidence.json`): the settings, the cuts and the ranker; the
    counts are rebuilt from the training sequences, which travel with it (a served version's
    catalogue)."""
    spec = {**asdict(evidence.table.config), "cuts": evidence.scale.to_dict()}
    return spec | ({"ranker": evidence.ranker.to_dict()} if evidence.ranker is not None else {})


def shows_evidence(spec: Mapping[str, Any] | None) -> bool:
    """Whether prompts built from the saved `spec` show evidence."""
    return bool(spec) and EvidenceConfig(**_settings(spec)).shown  # type: ignore[arg-type]


def _settings(spec: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k not in ("cuts", "ranker")}


def evidence_from_spec(spec: Mapping[str, Any], sequences: pd.DataFrame, items: pd.DataFrame) -> Evidence:
    """The `Evidence` a spec describes, over `sequences` (`user_id`, `train_items`) and `items`."""
    table = EvidenceTable.from_frames(sequences, items, EvidenceConfig(**_settings(spec)))
    ranker = LinearRanker.from_dict(spec["ranker"]) if spec.get("ranker") else None
    return Evidence(table, EvidenceScale.from_dict(spec["cuts"]), ranker)
