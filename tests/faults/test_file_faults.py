"""Whole-file and whole-dataset faults: a clear stop naming the file (and line), or a named
preparation error; and the inputs that used to lose good rows (BOM, CRLF) now keep them."""

from __future__ import annotations

import gzip
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from diffusion_gr2.core.data.expectations import check_splits
from diffusion_gr2.core.data.prepare import PrepConfig, prepare
from diffusion_gr2.core.data.raw import CorruptFileError, DataQualityError, ReadConfig
from diffusion_gr2.core.data.readers import RawFolderError, read_raw
from diffusion_gr2.core.io import atomic_write_json

from .conftest import AMAZON_2014, AMAZON_2023, GOOD, RECBOLE, raw_folder, write_bytes


def _truncated_gzip(folder: Path) -> Path:
    raw_folder(folder, AMAZON_2014)
    path = folder / "reviews_Beauty_5.json.gz"
    lines = [AMAZON_2014.review(k).encode() for k in range(2000)]  # big enough to span deflate blocks
    data = gzip.compress(b"".join(line + b"\n" for line in lines))
    path.write_bytes(data[: len(data) // 2])
    (folder / "reviews_Beauty_5.json").unlink()
    return path


def _not_gzip(folder: Path) -> Path:
    raw_folder(folder, AMAZON_2014)
    path = folder / "reviews_Beauty_5.json.gz"
    (folder / "reviews_Beauty_5.json").rename(path)  # plain text under a .gz name
    return path


def _gzip_named_plain(folder: Path) -> Path:
    raw_folder(folder, AMAZON_2014)
    path = folder / "reviews_Beauty_5.json"
    path.write_bytes(gzip.compress(path.read_bytes()))
    return path


def _stray_meta(folder: Path) -> Path:
    raw_folder(folder, AMAZON_2023)
    (folder / "meta_All_Beauty.jsonl").unlink()
    return write_bytes(folder / "meta_All_Beauty.json", [AMAZON_2014.item(k).encode() for k in range(4)])


def _header_without_timestamp(folder: Path) -> Path:
    raw_folder(folder, RECBOLE)
    return write_bytes(folder / "toy.inter", [b"user_id:token\titem_id:token", b"u\tI1"])


def _header_repeats_column(folder: Path) -> Path:
    raw_folder(folder, RECBOLE)
    return write_bytes(
        folder / "toy.inter", [b"user_id:token\titem_id:token\ttimestamp:float\titem_id:token"]
    )


def _share_above_threshold(folder: Path) -> Path:
    return raw_folder(folder, AMAZON_2014, "not json at all")  # 1 bad of 9 rows > 5%


# (case id, builder returning the file the message must name, error type, pattern the message must match)
FILE_CASES: list[tuple[str, Callable[[Path], Path], type[Exception], str]] = [
    ("truncated_gzip", _truncated_gzip, CorruptFileError, r"unreadable after line \d+ \(compressed byte \d+ of \d+\)"),
    ("not_gzip", _not_gzip, CorruptFileError, r"not a gzip file .* expected 1f 8b"),
    ("gzip_named_plain", _gzip_named_plain, CorruptFileError, r"gzip data in a file not named \.gz"),
    ("stray_meta_of_other_release", _stray_meta, RawFolderError, r"amazon2023 interaction files but metadata"),
    ("recbole_header_no_timestamp", _header_without_timestamp, DataQualityError, r"line 1 .*\['timestamp'\]"),
    ("recbole_header_repeats_column", _header_repeats_column, DataQualityError, r"\['item_id'\] more than once"),
    ("reject_share_above_threshold", _share_above_threshold, DataQualityError,
     r"1 of 9 rows rejected .* first at line 3: malformed_json"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("build", "error", "pattern"), [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES]
)
def test_unreadable_file_stops_the_read_naming_it(
    tmp_path: Path, build: Callable[[Path], Path], error: type[Exception], pattern: str
) -> None:
    named = build(tmp_path)
    with pytest.raises(error, match=pattern) as err:
        read_raw(tmp_path, ReadConfig())
    assert named.name in str(err.value)


@pytest.mark.parametrize(
    ("layout", "transform"),
    [
        (AMAZON_2014, lambda b: b"\xef\xbb\xbf" + b),  # UTF-8 BOM before the first record
        (RECBOLE, lambda b: b"\xef\xbb\xbf" + b),  # BOM before the typed header
        (AMAZON_2014, lambda b: b.replace(b"\n", b"\r\n")),  # Windows line ends
    ],
    ids=["bom_jsonl", "bom_recbole_header", "crlf"],
)
def test_harmless_file_quirks_lose_no_row(
    tmp_path: Path, layout: object, transform: Callable[[bytes], bytes]
) -> None:
    path = raw_folder(tmp_path, layout)  # type: ignore[arg-type]
    path.write_bytes(transform(path.read_bytes()))
    raw = read_raw(tmp_path)
    assert raw.rejects.empty and len(raw.interactions) == GOOD
    assert sorted(raw.interactions["raw_user_id"]) == sorted(f"u{k}" for k in range(GOOD))


# ---- preparation ---------------------------------------------------------------------------------
def _raw(rows: list[tuple[str, str, int]], rated: bool = True, folder: Path | None = None):
    """A RawDataset through the real reader: a RecBole file of ``(user, item, time)`` rows."""
    assert folder is not None
    header = "user_id:token\titem_id:token\t" + ("rating:float\t" if rated else "") + "timestamp:float"
    lines = [header] + [f"{u}\t{i}\t" + ("4\t" if rated else "") + str(t) for u, i, t in rows]
    write_bytes(folder / "x.inter", [line.encode() for line in lines])
    return read_raw(folder)


def _repeats() -> list[tuple[str, str, int]]:
    """3 users x 4 items, every user consuming item a twice: only valid without dedup."""
    rows = []
    for u in "xyz":
        rows += [(u, "a", 1), (u, "b", 2), (u, "c", 3), (u, "d", 4), (u, "a", 5)]
    return rows


def test_dedup_false_keeps_repeats_and_its_split_validates(tmp_path: Path) -> None:
    raw = _raw(_repeats(), folder=tmp_path)
    prepared = prepare(raw, PrepConfig(dedup=False, k_core=1))
    assert len(prepared.interactions) == 15
    assert (prepared.splits["test_item"] == prepared.splits["train_items"].map(lambda t: t[0])).all()
    assert check_splits(prepared.splits, len(prepared.items), allow_repeats=True).success
    assert len(prepare(raw, PrepConfig(dedup=True, k_core=1)).interactions) == 12


PREP_CASES = [
    ("min_rating_without_ratings", False, PrepConfig(k_core=1, min_rating=4.0),
     r"min_rating=4\.0 is set but none of the 15 interactions has a rating"),
    ("min_rating_keeps_nothing", True, PrepConfig(k_core=1, min_rating=5.0),
     r"min_rating=5\.0 keeps none of the 15 interactions \(ratings range 4\.0\.\.4\.0\)"),
    ("k_core_keeps_nothing", True, PrepConfig(k_core=50), r"no interactions left after 50-core"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("rated", "config", "pattern"), [c[1:] for c in PREP_CASES], ids=[c[0] for c in PREP_CASES]
)
def test_preparation_that_cannot_work_names_its_step(
    tmp_path: Path, rated: bool, config: PrepConfig, pattern: str
) -> None:
    raw = _raw(_repeats(), rated=rated, folder=tmp_path)
    with pytest.raises(ValueError, match=pattern) as err:
        prepare(raw, config)
    assert str(tmp_path) in str(err.value)


def test_every_row_rejected_is_named_not_blamed_on_k_core(tmp_path: Path) -> None:
    write_bytes(tmp_path / "x.inter", [b"user_id:token\titem_id:token\ttimestamp:float", b"u\ti\tnever"])
    raw = read_raw(tmp_path, ReadConfig(max_reject_share=None))
    with pytest.raises(
        ValueError, match=r"no valid interaction rows were read \(1 read, 1 rejected: \{'bad_time"
    ):
        prepare(raw, PrepConfig(max_reject_share=None))


# ---- reports -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value",
    [math.nan, math.inf, -math.inf, np.float32("nan"), np.array([1.0, np.nan]), pd.NA],
    ids=["nan", "inf", "-inf", "np_nan", "array_with_nan", "pd_na"],
)
def test_report_json_is_strict(tmp_path: Path, value: object) -> None:
    path = atomic_write_json(tmp_path / "r.json", {"metric": value, "nested": [{"x": value}]})
    text = path.read_text()
    assert not re.search(r"NaN|Infinity", text)
    json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in strict JSON"))
