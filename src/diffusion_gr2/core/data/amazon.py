"""Readers for the Amazon Reviews dumps: 2014 (McAuley), 2018 (Ni et al.) and 2023 (Hou et al.).

All three are one record per line, plain or gzip. They differ in field names, in the metadata layout
and in the timestamp unit (2023 uses milliseconds; `parse_timestamp` reads the unit off each value, so
a 2023 file re-exported in seconds is not turned into 1970 dates). Metadata is read first so that an interaction with
an item absent from the metadata can be rejected as ``unknown_item`` while its raw line is at hand.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from diffusion_gr2.core.data.raw import (
    InteractionRow,
    ItemRow,
    RawDataset,
    ReadConfig,
    RejectRow,
    Rejects,
    build_raw_dataset,
    collect_item_rows,
    flatten_categories,
    item_row,
    iter_lines,
    parse_id,
    parse_lines,
    parse_rating,
    parse_record,
    parse_timestamp,
    require,
)


@dataclass(frozen=True)
class ReviewFields:
    """Where one Amazon release keeps the interaction fields."""

    user: str
    item: str
    rating: str
    time: str


REVIEW_FIELDS = {
    "amazon2014": ReviewFields("reviewerID", "asin", "overall", "unixReviewTime"),
    "amazon2018": ReviewFields("reviewerID", "asin", "overall", "unixReviewTime"),
    "amazon2023": ReviewFields("user_id", "parent_asin", "rating", "timestamp"),
}


@dataclass(frozen=True)
class MetaFields:
    """Where one Amazon release keeps the metadata fields (title, price, description never move)."""

    item: str  # the item key
    categories: tuple[str, ...]  # category fields, first non-empty wins
    brand: str


META_FIELDS: dict[str, MetaFields] = {
    # 2014: ``categories`` is a list of category paths, ``description`` a string.
    "amazon2014": MetaFields("asin", ("categories",), "brand"),
    # 2018: ``category`` list (else ``main_cat``), price string like ``"$12.99"``, ``description`` list.
    "amazon2018": MetaFields("asin", ("category", "main_cat"), "brand"),
    # 2023: keyed by ``parent_asin``; the brand is the ``store``.
    "amazon2023": MetaFields("parent_asin", ("categories", "main_category"), "store"),
}


def parse_meta(record: dict[str, Any], fields: MetaFields) -> ItemRow:
    """One metadata record as a normalised item row."""
    item = parse_id(require(record, fields.item), fields.item)
    categories: list[str] = []
    for key in fields.categories:
        categories = categories or flatten_categories(record.get(key), key)
    return item_row(
        item,
        record.get("title"),
        categories,
        record.get(fields.brand),
        record.get("price"),
        record.get("description"),
    )


def read_meta_file(
    path: Path, parse: Callable[[dict[str, Any]], ItemRow], rejects: Rejects, seen: set[str]
) -> list[ItemRow]:
    """Normalised metadata rows of one file; repeated item ids after the first are rejected."""
    return collect_item_rows(
        path,
        iter_lines(path, rejects),
        lambda text: parse(parse_record(text, allow_python_literal=True)),
        rejects,
        seen,
    )


def parse_review(record: dict[str, Any], fields: ReviewFields, config: ReadConfig) -> InteractionRow:
    """One interaction from a review record, or `RejectRow` with the first problem found."""
    user = parse_id(require(record, fields.user), fields.user)
    item = parse_id(require(record, fields.item), fields.item)
    timestamp = parse_timestamp(require(record, fields.time))
    rating = parse_rating(require(record, fields.rating), config)
    return user, item, timestamp, rating


def read_review_file(
    path: Path, fields: ReviewFields, config: ReadConfig, rejects: Rejects, known_items: set[str] | None
) -> list[InteractionRow]:
    """Interactions of one review file; ``known_items`` (when metadata exists) rejects unknown items."""

    def parse(text: str) -> InteractionRow:
        row = parse_review(parse_record(text, allow_python_literal=False), fields, config)
        if known_items is not None and row[1] not in known_items:
            raise RejectRow("unknown_item")
        return row

    return parse_lines(path, iter_lines(path, rejects), parse, rejects)


def read_amazon(
    fmt: str, review_files: list[Path], meta_files: list[Path], config: ReadConfig, source: Path
) -> RawDataset:
    """Read one Amazon release (``fmt`` in `REVIEW_FIELDS`) from its review and metadata files."""
    rejects = Rejects()
    seen: set[str] = set()
    items: list[ItemRow] = []
    for path in meta_files:
        items.extend(read_meta_file(path, partial(parse_meta, fields=META_FIELDS[fmt]), rejects, seen))
    known = seen if meta_files else None
    interactions: list[InteractionRow] = []
    for path in review_files:
        interactions.extend(read_review_file(path, REVIEW_FIELDS[fmt], config, rejects, known))
    return build_raw_dataset(interactions, items, rejects, fmt, source, has_metadata=bool(meta_files))
