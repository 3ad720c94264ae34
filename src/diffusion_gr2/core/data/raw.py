"""Shared pieces of the raw readers: the `RawDataset` they return, line streaming, value parsing, rejects.

Every reader turns one raw format into the same `RawDataset`. A row that cannot be used is never
dropped silently: it goes to ``rejects`` with its file, 1-based line and a reason code, and
`check_reject_share` stops the run when a file's rejected share exceeds the threshold (DESIGN §3).
"""

from __future__ import annotations

import ast
import gzip
import json
import logging
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

# Rows the readers collect before building frames: raw ids, text fields, timestamp, rating.
ItemRow = tuple[str, str, list[str], str, float, str]
InteractionRow = tuple[str, str, int, float]

RAW_INTERACTION_COLUMNS = ["raw_user_id", "raw_item_id", "timestamp", "rating"]
RAW_ITEM_COLUMNS = ["raw_item_id", "title", "categories", "brand", "price", "description"]
REJECT_COLUMNS = ["file", "line", "reason", "raw"]
MAX_TIMESTAMP_S = 4_102_444_800  # 2100-01-01: anything later is a unit mistake (ms read as s), not data
RAW_EXCERPT_CHARS = 500  # rejects keep the first 500 characters of the offending line (architecture.md)


class DataQualityError(ValueError):
    """Too many rows of one raw file were rejected; the message names file, first line and reason."""


class RejectRow(Exception):
    """Raised inside a row parser to send the current line to the rejects with ``reason``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class ReadConfig:
    """How strict the raw readers are."""

    max_reject_share: float | None = 0.05  # per file; above it the run stops (None: never stop)
    rating_min: float = 1.0  # Amazon "overall" and MovieLens ratings are 1..5 stars
    rating_max: float = 5.0


@dataclass(frozen=True)
class RawDataset:
    """What every reader returns.

    ``interactions``: ``raw_user_id:str, raw_item_id:str, timestamp:int64 (unix s), rating:float64``
    in file order (files in sorted name order), which later breaks timestamp ties.
    ``items``: ``raw_item_id, title, categories (list[str]), brand, price (float, NaN), description``;
    empty when the dataset has no metadata file (``has_metadata`` False).
    ``rejects``: ``file, line (1-based), reason, raw``. ``rows_read``: data lines read over all files;
    ``rows_by_file``: the same per file, for the per-file rejected share.
    """

    interactions: pd.DataFrame
    items: pd.DataFrame
    rejects: pd.DataFrame
    rows_read: int
    rows_by_file: dict[str, int]
    format: str
    source: str
    has_metadata: bool

    def rejected_by_reason(self) -> dict[str, int]:
        """Reject counts per reason code, most frequent first."""
        return dict(Counter(self.rejects["reason"]).most_common())


@dataclass
class Rejects:
    """Accumulates rejected lines and data-line counts per file while a reader streams."""

    rows: list[tuple[str, int, str, str]] = field(default_factory=list)
    rows_by_file: dict[str, int] = field(default_factory=dict)

    def add(self, file: Path | str, line: int, reason: str, raw: str) -> None:
        self.rows.append((str(file), line, reason, raw[:RAW_EXCERPT_CHARS]))

    def frame(self) -> pd.DataFrame:
        frame = pd.DataFrame(self.rows, columns=REJECT_COLUMNS)
        return frame.astype({"file": str, "line": "int64", "reason": str, "raw": str})


def iter_lines(path: Path, rejects: Rejects, has_header: bool = False) -> Iterator[tuple[int, str]]:
    """Yield ``(line_number, text)`` for each non-blank line of a plain or gzip file, streaming.

    Lines are decoded one at a time so a single bad byte sequence rejects one line (``bad_encoding``)
    instead of aborting the file. Every non-blank line counts towards ``rows_by_file`` except the
    header (the first non-blank line, when ``has_header``), which is still yielded.
    """
    name = str(path)
    rejects.rows_by_file.setdefault(name, 0)
    opener = gzip.open if path.name.endswith(".gz") else open
    pending_header = has_header
    with opener(path, "rb") as handle:
        for number, raw in enumerate(tqdm(handle, desc=path.name, unit=" lines", disable=None), start=1):
            if not raw.strip():
                continue
            if pending_header:
                pending_header = False
                yield number, raw.decode("utf-8", "replace").rstrip("\r\n")
                continue
            rejects.rows_by_file[name] += 1
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                rejects.add(name, number, "bad_encoding", raw.decode("utf-8", "replace"))
                continue
            yield number, text.rstrip("\r\n")


def parse_record(text: str, allow_python_literal: bool) -> dict[str, Any]:
    """Parse one JSON-lines record; metadata files of Amazon 2014 are Python dict literals.

    ``ast.literal_eval`` only builds literals, so it is safe on untrusted input (never ``eval``).
    """
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        if not allow_python_literal:
            raise RejectRow("malformed_json") from None
        try:
            record = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            raise RejectRow("malformed_json") from None
    if not isinstance(record, dict):
        raise RejectRow("malformed_json")
    return record


def require(record: dict[str, Any], key: str) -> Any:
    """The value of a required field; missing, null or blank values reject the row."""
    value = record.get(key)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise RejectRow(f"missing_field:{key}")
    return value


def parse_id(value: Any, key: str) -> str:
    """An identifier as a stripped string (JSON may hold it as a number)."""
    if isinstance(value, bool | dict | list | float):
        raise RejectRow(f"bad_id:{key}")
    text = str(value).strip()
    if not text:
        raise RejectRow(f"missing_field:{key}")
    return text


def parse_timestamp(value: Any, scale: int = 1) -> int:
    """Unix seconds from an int/float/numeric string given in units of ``1/scale`` seconds."""
    if isinstance(value, bool):
        raise RejectRow("bad_timestamp")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RejectRow("bad_timestamp") from None
    if not math.isfinite(number):
        raise RejectRow("bad_timestamp")
    seconds = int(number // scale)
    if not 0 <= seconds <= MAX_TIMESTAMP_S:
        raise RejectRow("bad_timestamp")
    return seconds


def parse_rating(value: Any, config: ReadConfig) -> float:
    """A rating as float inside ``[rating_min, rating_max]``."""
    if isinstance(value, bool):
        raise RejectRow("bad_rating")
    try:
        rating = float(value)
    except (TypeError, ValueError):
        raise RejectRow("bad_rating") from None
    if not math.isfinite(rating):
        raise RejectRow("bad_rating")
    if not config.rating_min <= rating <= config.rating_max:
        raise RejectRow("rating_out_of_range")
    return rating


_PRICE_RE = re.compile(r"\d[\d,]*(?:\.\d+)?")


def clean_text(value: Any) -> str:
    """A free-text field as one stripped string; lists (2018/2023 descriptions) are joined."""
    if value is None:
        return ""
    if isinstance(value, list | tuple):
        return " ".join(part for part in (clean_text(v) for v in value) if part)
    if isinstance(value, float) and math.isnan(value):
        return ""
    return str(value).strip()


def parse_price(value: Any) -> float:
    """A price as float, NaN when absent or unreadable; ``"$10.00 - $20.00"`` gives the lower bound.

    Only strings that start like a price are read: Amazon 2018 metadata sometimes holds page markup
    in this field, whose digits must not become a price.
    """
    if isinstance(value, bool) or value is None:
        return math.nan
    if isinstance(value, int | float):
        return float(value) if math.isfinite(value) and value >= 0 else math.nan
    text = str(value).strip()
    if not text or not (text[0] == "$" or text[0].isdigit()):
        return math.nan
    match = _PRICE_RE.search(text)
    return float(match.group().replace(",", "")) if match else math.nan


def flatten_categories(value: Any) -> list[str]:
    """Categories as a flat, de-duplicated list in first-seen order.

    Accepts a string, a list of strings (2018/2023) or a list of lists (2014 category paths).
    Entries that are markup fragments (2018 metadata) are skipped.
    """
    out: list[str] = []
    stack = [value] if isinstance(value, str) else list(value or [])
    for entry in stack:
        parts = entry if isinstance(entry, list | tuple) else [entry]
        for part in parts:
            text = clean_text(part)
            if text and not text.startswith("<") and text not in out:
                out.append(text)
    return out


def item_row(
    raw_item_id: str, title: Any, categories: list[str], brand: Any, price: Any, description: Any
) -> tuple[str, str, list[str], str, float, str]:
    """One normalised metadata row in ``RAW_ITEM_COLUMNS`` order."""
    return (
        raw_item_id,
        clean_text(title),
        categories,
        clean_text(brand),
        parse_price(price),
        clean_text(description),
    )


def interactions_frame(rows: list[tuple[str, str, int, float]]) -> pd.DataFrame:
    """The raw interactions frame with its dtypes fixed (also when empty)."""
    frame = pd.DataFrame(rows, columns=RAW_INTERACTION_COLUMNS)
    return frame.astype({"raw_user_id": str, "raw_item_id": str, "timestamp": "int64", "rating": "float64"})


def items_frame(rows: list[tuple[str, str, list[str], str, float, str]]) -> pd.DataFrame:
    """The raw items frame with its dtypes fixed (also when empty)."""
    frame = pd.DataFrame(rows, columns=RAW_ITEM_COLUMNS)
    return frame.astype(
        {"raw_item_id": str, "title": str, "brand": str, "price": "float64", "description": str}
    )


def check_reject_share(raw: RawDataset, max_share: float | None) -> None:
    """Raise `DataQualityError` when one file's rejected share exceeds ``max_share``.

    The share is per file so that a broken small file is not hidden by a large healthy one.
    """
    if max_share is None or raw.rejects.empty:
        return
    for file, group in raw.rejects.groupby("file", sort=False):
        read = max(raw.rows_by_file.get(str(file), len(group)), 1)
        if len(group) / read > max_share:
            first = group.sort_values("line", kind="stable").iloc[0]
            reasons = dict(Counter(group["reason"]).most_common())
            raise DataQualityError(
                f"{file}: {len(group)} of {read} rows rejected ({len(group) / read:.1%} > "
                f"max_reject_share {max_share:.1%}); first at line {first['line']}: {first['reason']} "
                f"(raw: {first['raw'][:120]!r}); by reason: {reasons}"
            )


def log_rejects(raw: RawDataset) -> None:
    """Log the reject counts (one warning line) so nothing is set aside unseen."""
    if raw.rejects.empty:
        logger.info("%s: read %d rows, none rejected", raw.source, raw.rows_read)
        return
    logger.warning(
        "%s: read %d rows, rejected %d %s (see the rejects frame)",
        raw.source,
        raw.rows_read,
        len(raw.rejects),
        raw.rejected_by_reason(),
    )


def build_raw_dataset(
    interactions: list[tuple[str, str, int, float]],
    items: list[tuple[str, str, list[str], str, float, str]],
    rejects: Rejects,
    fmt: str,
    source: Path | str,
    has_metadata: bool,
) -> RawDataset:
    """Assemble the frames a reader collected into a `RawDataset` and log its rejects."""
    raw = RawDataset(
        interactions=interactions_frame(interactions),
        items=items_frame(items),
        rejects=rejects.frame(),
        rows_read=sum(rejects.rows_by_file.values()),
        rows_by_file=dict(rejects.rows_by_file),
        format=fmt,
        source=str(source),
        has_metadata=has_metadata,
    )
    log_rejects(raw)
    return raw


def collect_item_rows(
    path: Path,
    lines: Iterable[tuple[int, str]],
    parse: Callable[[str], ItemRow],
    rejects: Rejects,
    seen: set[str],
) -> list[ItemRow]:
    """Parse metadata lines; a bad line or a repeated item id goes to the rejects with its reason."""
    rows: list[ItemRow] = []
    for number, text in lines:
        try:
            row = parse(text)
            if row[0] in seen:
                raise RejectRow("duplicate_item")
        except RejectRow as reject:
            rejects.add(path, number, reject.reason, text)
            continue
        seen.add(row[0])
        rows.append(row)
    return rows
