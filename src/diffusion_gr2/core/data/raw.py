"""Shared pieces of the raw readers: the `RawDataset` they return, line streaming, value parsing, rejects.

Every reader turns one raw format into the same `RawDataset`. A row that cannot be used is never
dropped silently: it goes to ``rejects`` with its file, 1-based line and a reason code, and
`check_reject_share` stops the run when a file's rejected share exceeds the threshold
(docs/architecture.md#data).
"""

from __future__ import annotations

import ast
import gzip
import json
import logging
import math
import re
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

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
# Unix times at or above 1e11 are milliseconds: in seconds that is the year 5138, while every
# millisecond time after March 1973 is above it. So the unit is read off each value, which is how
# 2023 dumps (ms) and re-exports in seconds both come out right instead of landing in 1970.
MILLISECONDS_FROM = 10**11
MAX_TIMESTAMP_MS = MAX_TIMESTAMP_S * 1000
GZIP_MAGIC = b"\x1f\x8b"
BOM = "\ufeff"
RAW_EXCERPT_CHARS = 500  # rejects keep the first 500 characters of the offending line (architecture.md)


class DataQualityError(ValueError):
    """Too many rows of one raw file were rejected; the message names file, first line and reason."""


class CorruptFileError(DataQualityError):
    """A raw file cannot be read to its end (bad or truncated compression); names file and position."""


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


def _open_binary(path: Path) -> Any:
    """A binary handle on ``path``: gzip when the name ends with ``.gz``, after checking the magic bytes.

    A mismatch between name and content is a corrupt file, not a page of ``bad_encoding`` rejects.
    """
    with open(path, "rb") as probe:
        head = probe.read(2)
    is_gzip = path.name.endswith(".gz")
    if is_gzip and head != GZIP_MAGIC:
        raise CorruptFileError(
            f"{path}: not a gzip file (starts with bytes {head!r}, expected 1f 8b); "
            "decompress it or drop the .gz suffix if it is plain text"
        )
    if not is_gzip and head == GZIP_MAGIC:
        raise CorruptFileError(f"{path}: gzip data in a file not named .gz; rename it to {path.name}.gz")
    return gzip.open(path, "rb") if is_gzip else open(path, "rb")


def _corrupt(path: Path, line: int, handle: Any, err: BaseException) -> CorruptFileError:
    """The error for a file whose stream breaks after ``line``, with the compressed byte reached."""
    raw = getattr(handle, "fileobj", None)
    where = f"compressed byte {raw.tell()} of {path.stat().st_size}" if raw is not None else "end of file"
    return CorruptFileError(
        f"{path}: unreadable after line {line} ({where}): {type(err).__name__}: {err}; "
        "expected a complete gzip stream (the file is truncated or damaged: download it again)"
    )


def iter_lines(path: Path, rejects: Rejects, has_header: bool = False) -> Iterator[tuple[int, str]]:
    """Yield ``(line_number, text)`` for each non-blank line of a plain or gzip file, streaming.

    Lines are decoded one at a time so a single bad byte sequence rejects one line (``bad_encoding``)
    instead of aborting the file. A UTF-8 byte-order mark before the first line is dropped (editors
    on Windows write one). Every non-blank line counts towards ``rows_by_file`` except the header
    (the first non-blank line, when ``has_header``), which is still yielded. A stream that breaks
    (truncated or damaged gzip) raises `CorruptFileError` naming the file and the last good line.
    """
    name = str(path)
    rejects.rows_by_file.setdefault(name, 0)
    pending_header = has_header
    number = 0
    with _open_binary(path) as handle:
        lines = enumerate(tqdm(handle, desc=path.name, unit=" lines", disable=None), start=1)
        while True:
            try:
                number, raw = next(lines)
            except StopIteration:
                return
            except (EOFError, OSError, zlib.error) as err:  # BadGzipFile is an OSError
                raise _corrupt(path, number, handle, err) from err
            if number == 1 and raw.startswith(BOM.encode()):
                raw = raw[len(BOM.encode()) :]
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


Row = TypeVar("Row")
# Parse failures of the standard library that a hostile line can still provoke: they reject the line
# (reason names the exception) rather than end the read, and the reject share rule still applies.
_ROW_ERRORS = (ValueError, TypeError, OverflowError, RecursionError, UnicodeError)


def parse_lines(
    path: Path, lines: Iterable[tuple[int, str]], parse: Callable[[str], Row], rejects: Rejects
) -> list[Row]:
    """The one place where a raw line becomes a row or a reject: ``parse(text)`` or its `RejectRow`.

    Every reader streams its lines through here, so no parse problem can end a read or vanish.
    """
    rows: list[Row] = []
    for number, text in lines:
        try:
            rows.append(parse(text))
        except RejectRow as reject:
            rejects.add(path, number, reject.reason, text)
        except _ROW_ERRORS as err:
            logger.debug("%s line %d: %s", path, number, err)
            rejects.add(path, number, f"malformed_record:{type(err).__name__}", text)
    return rows


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's dict; a key given twice rejects the line (which of the two values is meant?)."""
    record = dict(pairs)
    if len(record) != len(pairs):
        raise RejectRow("duplicate_key")
    return record


def parse_record(text: str, allow_python_literal: bool) -> dict[str, Any]:
    """Parse one JSON-lines record; metadata files of Amazon 2014 are Python dict literals.

    ``ast.literal_eval`` only builds literals, so it is safe on untrusted input (never ``eval``).
    Numbers too large for Python (a 5,000-digit integer) make the line malformed, like bad syntax.
    """
    try:
        record = json.loads(text, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError):  # JSONDecodeError, or an integer beyond the digit limit
        if not allow_python_literal:
            raise RejectRow("malformed_json") from None
        try:
            record = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError, OverflowError):
            raise RejectRow("malformed_json") from None
    if not isinstance(record, dict):
        raise RejectRow("malformed_json")
    return record


def check_text(text: str, key: str) -> str:
    """``text`` itself, or a reject when it cannot be stored as UTF-8 (a lone surrogate from ``\\ud800``).

    Caught here, on its line, rather than at the parquet save where no row is named.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RejectRow(f"bad_text:{key}") from None
    return text


def require(record: dict[str, Any], key: str) -> Any:
    """The value of a required field; missing, null or blank values reject the row."""
    value = record.get(key)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise RejectRow(f"missing_field:{key}")
    return value


def parse_id(value: Any, key: str) -> str:
    """An identifier as a stripped string (JSON may hold it as a number)."""
    if not isinstance(value, str | int) or isinstance(value, bool):
        raise RejectRow(f"bad_id:{key}")
    text = check_text(str(value).strip(), key)
    if not text:
        raise RejectRow(f"missing_field:{key}")
    return text


def _number(value: Any) -> float | int | None:
    """``value`` as an int or a finite float; None when it is not a number (bools are not numbers)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def parse_timestamp(value: Any) -> int:
    """Unix seconds from an int/float/numeric string in seconds or milliseconds (see `MILLISECONDS_FROM`)."""
    number = _number(value)
    if number is None:
        raise RejectRow("bad_timestamp")
    if number >= MILLISECONDS_FROM:
        if number > MAX_TIMESTAMP_MS:
            raise RejectRow("bad_timestamp")
        number = number // 1000
    seconds = int(number)
    if not 0 <= seconds <= MAX_TIMESTAMP_S:
        raise RejectRow("bad_timestamp")
    return seconds


def parse_rating(value: Any, config: ReadConfig) -> float:
    """A rating as float inside ``[rating_min, rating_max]``."""
    number = _number(value)
    if number is None:
        raise RejectRow("bad_rating")
    if not config.rating_min <= number <= config.rating_max:
        raise RejectRow("rating_out_of_range")
    return float(number)


_PRICE_RE = re.compile(r"\d[\d,]*(?:\.\d+)?")


def clean_text(value: Any, key: str) -> str:
    """A free-text field as one stripped string; a list of strings (2018/2023 descriptions) is joined.

    A number is read as its text. Anything else (a dict, a nested list, a list holding null) is not
    text: the row is rejected as ``bad_field:<key>`` rather than stored as a Python repr.
    """
    if value is None:
        return ""
    if isinstance(value, str):
        return check_text(value.strip(), key)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "" if isinstance(value, float) and not math.isfinite(value) else str(value)
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return " ".join(part for part in (check_text(v.strip(), key) for v in value) if part)
    raise RejectRow(f"bad_field:{key}")


def parse_price(value: Any) -> float:
    """A price as float, NaN when absent or unreadable; ``"$10.00 - $20.00"`` gives the lower bound.

    Only strings that start like a price are read: Amazon 2018 metadata sometimes holds page markup
    in this field, whose digits must not become a price.
    """
    if isinstance(value, bool) or value is None:
        return math.nan
    if isinstance(value, int | float):
        number = _number(value)
        return float(number) if number is not None and number >= 0 else math.nan
    text = str(value).strip()
    if not text or not (text[0] == "$" or text[0].isdigit()):
        return math.nan
    match = _PRICE_RE.search(text)
    if not match:
        return math.nan
    price = float(match.group().replace(",", ""))
    return price if math.isfinite(price) else math.nan


def flatten_categories(value: Any, key: str = "categories") -> list[str]:
    """Categories as a flat, de-duplicated list in first-seen order.

    Accepts a string, a list of strings (2018/2023) or a list of lists of strings (2014 category
    paths); any other shape (a number, a dict, a list holding null or numbers) rejects the row as
    ``bad_field:<key>``. Entries that are markup fragments (2018 metadata) are skipped.
    """
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple):
        raise RejectRow(f"bad_field:{key}")
    out: list[str] = []
    for entry in value:
        parts = entry if isinstance(entry, list | tuple) else [entry]
        if not all(isinstance(part, str) for part in parts):
            raise RejectRow(f"bad_field:{key}")
        for part in parts:
            text = check_text(part.strip(), key)
            if text and not text.startswith("<") and text not in out:
                out.append(text)
    return out


def item_row(
    raw_item_id: str, title: Any, categories: list[str], brand: Any, price: Any, description: Any
) -> tuple[str, str, list[str], str, float, str]:
    """One normalised metadata row in ``RAW_ITEM_COLUMNS`` order."""
    return (
        raw_item_id,
        clean_text(title, "title"),
        categories,
        clean_text(brand, "brand"),
        parse_price(price),
        clean_text(description, "description"),
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

    def first_of_its_id(text: str) -> ItemRow:
        row = parse(text)
        if row[0] in seen:
            raise RejectRow("duplicate_item")
        seen.add(row[0])
        return row

    return parse_lines(path, lines, first_of_its_id, rejects)
