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
* `pop`: its interactions in other users' training sequences (log scale).

The prompt shows each signal as a level 0..`levels`-1, cut at quantiles of the training requests'
candidates (`EvidenceScale`), so every number the teacher cites is one the prompt shows.
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

SIGNALS = ("fit", "year", "after", "pop")
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

    def __post_init__(self) -> None:
        if not 2 <= self.levels <= 10:
            raise ValueError(f"traces.evidence.levels must be in 2..10 (one digit), got {self.levels}")
        if self.recent < 1 or self.window < 1:
            raise ValueError(f"traces.evidence.recent and window must be >= 1, got {self}")


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

    def raw(self, user_id: int, history: Sequence[int], candidates: Sequence[int]) -> np.ndarray:
        """[n, 4] raw signals per candidate, in the order of `SIGNALS` (larger = more likely)."""
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
class Evidence:
    """What the prompt states per candidate: the counts, and the cuts that turn them into levels."""

    table: EvidenceTable
    scale: EvidenceScale

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


def evidence_spec(evidence: Evidence) -> dict[str, Any]:
    """What a run saves of its evidence (`evidence.json`): the settings and the cuts; the counts are
    rebuilt from the training sequences, which travel with it (a served version's catalogue)."""
    return {**asdict(evidence.table.config), "cuts": evidence.scale.to_dict()}


def evidence_from_spec(spec: Mapping[str, Any], sequences: pd.DataFrame, items: pd.DataFrame) -> Evidence:
    """The `Evidence` a spec describes, over `sequences` (`user_id`, `train_items`) and `items`."""
    config = EvidenceConfig(**{k: v for k, v in spec.items() if k != "cuts"})
    table = EvidenceTable.from_frames(sequences, items, config)
    return Evidence(table, EvidenceScale.from_dict(spec["cuts"]))
