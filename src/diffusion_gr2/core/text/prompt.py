"""Prompt template and answer rendering for the re-ranker (docs/architecture.md#items-candidates-and-prompts).

The prompt shows the user's recent history and the candidates, each as a semantic ID (SID) followed by
a short title and a few categories, so that a tiny model on two CPU cores sees ~250-400 tokens. The
answer is a compact JSON object `{"explanation": ..., "recommendations": [sid, ...]}`.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import pandas as pd

SYSTEM_PROMPT = (
    "You re-rank recommendations. Read the user's history and the candidates, each shown as an ID and "
    "its metadata, and rank every candidate from most to least likely next item. Reply with JSON only: "
    '{"explanation": short reasoning citing IDs, "recommendations": [all candidate IDs, best first]}'
)
_SEPARATOR = " | "  # field separator inside one item line; removed from the fields themselves


@dataclass(frozen=True)
class PromptConfig:
    """How much of each item the prompt shows. Defaults are conf/base's `traces.prompt`
    (tests/test_config.py holds them equal): a short prompt, so decoding is cheap on two cores."""

    history_in_prompt: int = 5  # most recent history items shown (older ones are dropped)
    title_words: int = 3  # a title is cut to its first words: long Amazon titles would dominate
    max_categories: int = 2  # categories shown per item, in listed order after dropping common ones
    max_category_share: float = 0.5  # categories on more than this share of items carry no signal

    def __post_init__(self) -> None:
        if self.history_in_prompt < 1 or self.title_words < 1 or self.max_categories < 0:
            raise ValueError(f"invalid PromptConfig: {self}")
        if not 0.0 < self.max_category_share <= 1.0:
            raise ValueError(f"max_category_share must be in (0, 1], got {self.max_category_share}")


@dataclass(frozen=True)
class ItemInfo:
    """What the prompt shows about one item (already shortened)."""

    sid: str  # "<a_12><b_7><c_21><d_3>"
    title: str  # first `title_words` words
    categories: tuple[str, ...]  # at most `max_categories`, uninformative ones removed
    brand: str  # "" when absent
    price: float  # NaN when absent


@dataclass(frozen=True)
class ItemLookup:
    """item_id -> ItemInfo, and the reverse map from SID to item_id."""

    items: Mapping[int, ItemInfo]
    sid_to_item: Mapping[str, int]

    def __getitem__(self, item_id: int) -> ItemInfo:
        return self.items[int(item_id)]

    def __contains__(self, item_id: object) -> bool:
        return item_id in self.items

    def sids(self, item_ids: Iterable[int]) -> list[str]:
        """SIDs of `item_ids`, in order."""
        return [self[i].sid for i in item_ids]

    def item_ids(self, sids: Iterable[str]) -> list[int]:
        """item_ids of `sids`, in order (KeyError on an unknown SID)."""
        return [self.sid_to_item[s] for s in sids]

    @classmethod
    def from_frames(cls, items: pd.DataFrame, sids: pd.DataFrame, config: PromptConfig) -> ItemLookup:
        """Join the `items` and `sids` frames (docs/architecture.md) on item_id.

        Items without a SID are left out. Categories carried by more than `max_category_share` of the
        items (e.g. "Beauty" on every Amazon Beauty item) are dropped before the first
        `max_categories` are kept, because they would tell the model nothing.
        """
        merged = items.merge(sids[["item_id", "sid"]], on="item_id", how="inner", validate="one_to_one")
        category_lists = [_category_list(c) for c in merged["categories"]]
        common = _common_categories(category_lists, config.max_category_share)
        table: dict[int, ItemInfo] = {}
        for row, cats in zip(merged.itertuples(index=False), category_lists, strict=True):
            kept = tuple(c for c in cats if c not in common)[: config.max_categories]
            table[int(row.item_id)] = ItemInfo(
                sid=str(row.sid),
                title=short_title(row.title if isinstance(row.title, str) else "", config.title_words),
                categories=kept,
                brand=_clean(str(row.brand)) if isinstance(row.brand, str) else "",
                price=_price(row.price),
            )
        return cls(items=table, sid_to_item={info.sid: i for i, info in table.items()})


def _clean(text: str) -> str:
    """One line of text without the field separator (it would make item lines ambiguous)."""
    return " ".join(text.replace("|", "/").split())


def short_title(title: str, words: int) -> str:
    """The first `words` words of a title, on one line."""
    return " ".join(_clean(title).split()[:words]) or "untitled"


def _category_list(value: object) -> list[str]:
    """Categories from a frame cell (list, numpy array, or None), cleaned and de-duplicated in order."""
    if value is None or isinstance(value, float | str):
        return [_clean(value)] if isinstance(value, str) and value.strip() else []
    seen: dict[str, None] = {}
    for c in value:  # type: ignore[attr-defined]
        cleaned = _clean(str(c))
        if cleaned:
            seen.setdefault(cleaned, None)
    return list(seen)


def _common_categories(category_lists: Sequence[list[str]], max_share: float) -> set[str]:
    """Categories present on more than `max_share` of the items."""
    if not category_lists:
        return set()
    counts = Counter(c for cats in category_lists for c in cats)
    return {c for c, n in counts.items() if n / len(category_lists) > max_share}


def _price(value: object) -> float:
    try:
        price = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan
    return price if math.isfinite(price) and price >= 0 else math.nan


def item_line(info: ItemInfo, with_offer: bool) -> str:
    """`SID title | cat1, cat2` and, for candidates, `| brand, $price` where present."""
    parts = [f"{info.sid} {info.title}", ", ".join(info.categories) or "-"]
    if with_offer:
        offer = [info.brand] if info.brand else []
        if not math.isnan(info.price):
            offer.append(f"${info.price:.2f}")
        if offer:
            parts.append(", ".join(offer))
    return _SEPARATOR.join(parts)


@dataclass(frozen=True)
class PromptEvidence:
    """What one prompt shows of the evidence (`core/text/evidence.py`): a text per candidate appended
    to its line, and the candidates (indices, best first) the hint line names."""

    lines: tuple[str, ...] | None = None
    favoured: tuple[int, ...] = ()


HINT_PREFIX = "Evidence favours:"


def visible_history(history: Sequence[int], config: PromptConfig) -> list[int]:
    """The history items the prompt shows: the last `history_in_prompt`, oldest first."""
    return [int(i) for i in history][-config.history_in_prompt :]


def build_messages(
    history: Sequence[int],
    candidates: Sequence[int],
    item_lookup: ItemLookup,
    config: PromptConfig,
    evidence: PromptEvidence | None = None,
) -> list[dict[str, str]]:
    """Chat messages (system + user) for one re-ranking request.

    The history is chronological (most recent last) and the candidates are in pre-rank order; neither
    the target nor any retrieval score is shown. `evidence`'s texts are appended to each candidate's
    line, and its favoured candidates named on a last line (`Evidence favours: SID SID`).
    """
    lines = ["History (oldest to newest):"]
    lines += [item_line(item_lookup[i], with_offer=False) for i in visible_history(history, config)]
    lines.append(f"Candidates ({len(candidates)}):")
    shown = [item_line(item_lookup[i], with_offer=True) for i in candidates]
    evidence = evidence or PromptEvidence()
    if evidence.lines is not None:
        if len(evidence.lines) != len(candidates):
            raise ValueError(f"{len(evidence.lines)} evidence texts for {len(candidates)} candidates")
        shown = [f"{line}{_SEPARATOR}{text}" for line, text in zip(shown, evidence.lines, strict=True)]
    lines += shown
    if evidence.favoured:
        lines.append(" ".join([HINT_PREFIX, *(item_lookup[candidates[k]].sid for k in evidence.favoured)]))
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "\n".join(lines)}]


def render_answer(explanation: str, ranking_sids: Sequence[str]) -> str:
    """The assistant answer as compact JSON (no spaces after separators: fewer tokens per SID)."""
    payload = {"explanation": explanation, "recommendations": [str(s) for s in ranking_sids]}
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


_SID_PART = re.compile(r"<[^<>\s]+>")


def split_sid(sid: str) -> list[str]:
    """The SID tokens of one SID string: "<a_1><b_2><c_3><d_4>" -> ["<a_1>", "<b_2>", "<c_3>", "<d_4>"]."""
    return _SID_PART.findall(sid)
