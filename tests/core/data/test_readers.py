"""Readers on fixture files in the exact raw formats, format detection, and the rejection path."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from diffusion_gr2.core.data.raw import DataQualityError, ReadConfig, parse_price
from diffusion_gr2.core.data.readers import (
    RawFolderError,
    classify_file,
    detect_format,
    read_dataset,
    read_raw,
    resolve_raw_folder,
)

from .conftest import json_lines, write_lines

LENIENT = ReadConfig(max_reject_share=None)

META_2014 = [
    # Python dict literals (single quotes), as in meta_Beauty.json.gz
    "{'asin': 'A1', 'title': \"L'Oreal Lipstick\", 'categories': [['Beauty', 'Makeup', 'Lips'], "
    "['Beauty', 'Makeup']], 'price': 12.5, 'brand': \"L'Oreal\", 'salesRank': {'Beauty': 12}, "
    "'related': {'also_bought': ['A2']}}",
    "{'asin': 'A2', 'description': 'A moisturiser', 'categories': [['Beauty', 'Skin Care']]}",
    "{'title': 'no asin here'}",
    '{"asin": "A3", "title": "plain JSON line"}',
]
REVIEWS_2014 = [
    '{"reviewerID": "U1", "asin": "A1", "overall": 5.0, "unixReviewTime": 1390000000, "reviewText": "ok"}',
    '{"reviewerID": "U1", "asin": "A2", "overall": 4.0, "unixReviewTime": 1390000100}',
    '{"reviewerID": "U2", "asin": "A1", "overall": 3.0, ',
    '{"reviewerID": "U2", "overall": 3.0, "unixReviewTime": 1390000200}',
    '{"reviewerID": "U2", "asin": "A3", "overall": 3.0, "unixReviewTime": "yesterday"}',
    '{"reviewerID": "U2", "asin": "A3", "overall": 7.0, "unixReviewTime": 1390000300}',
    '{"reviewerID": "U2", "asin": "A9", "overall": 2.0, "unixReviewTime": 1390000400}',
    "",
    '{"reviewerID": "U3", "asin": "A3", "overall": 1.0, "unixReviewTime": 1390000500}',
]


@pytest.mark.parametrize("suffix", [".json.gz", ".json"])
def test_amazon_2014(tmp_path: Path, suffix: str) -> None:
    write_lines(tmp_path / f"reviews_Beauty_5{suffix}", REVIEWS_2014)
    write_lines(tmp_path / f"meta_Beauty{suffix}", META_2014)
    raw = read_raw(tmp_path, LENIENT)
    assert raw.format == "amazon2014" and raw.has_metadata
    assert raw.interactions.values.tolist() == [
        ["U1", "A1", 1390000000, 5.0],
        ["U1", "A2", 1390000100, 4.0],
        ["U3", "A3", 1390000500, 1.0],
    ]
    items = raw.items.set_index("raw_item_id")
    assert items.loc["A1", "title"] == "L'Oreal Lipstick" and items.loc["A1", "brand"] == "L'Oreal"
    assert items.loc["A1", "categories"] == ["Beauty", "Makeup", "Lips"] and items.loc["A1", "price"] == 12.5
    assert items.loc["A2", "title"] == "" and math.isnan(items.loc["A2", "price"])
    assert items.loc["A2", "description"] == "A moisturiser"
    rejects = raw.rejects
    review_file = str(tmp_path / f"reviews_Beauty_5{suffix}")
    got = rejects[rejects.file == review_file][["line", "reason"]].values.tolist()
    assert got == [
        [3, "malformed_json"],
        [4, "missing_field:asin"],
        [5, "bad_timestamp"],
        [6, "rating_out_of_range"],
        [7, "unknown_item"],
    ]
    assert rejects[rejects.file != review_file][["line", "reason"]].values.tolist() == [
        [3, "missing_field:asin"]
    ]
    assert raw.rows_read == 8 + 4  # the blank line is not a row
    assert raw.rejected_by_reason()["missing_field:asin"] == 2


def test_amazon_2018(tmp_path: Path) -> None:
    write_lines(
        tmp_path / "All_Beauty.json",
        json_lines(
            [
                {
                    "overall": 5.0,
                    "verified": True,
                    "reviewerID": "U1",
                    "asin": "B1",
                    "unixReviewTime": 1472688000,
                },
                {"overall": 2.0, "reviewerID": "U1", "asin": "B2", "unixReviewTime": 1472688100},
                {"overall": 2.0, "reviewerID": "U2", "asin": "B2"},
            ]
        ),
    )
    meta = [
        {"asin": "B1", "title": "Soap", "category": ["All Beauty", "Bath"], "brand": "Acme", "price": "$12.99",
         "description": ["Gentle", "soap"]},
        {"asin": "B2", "title": "Brush", "price": ".a-box-inner{background-color:#fff}", "main_cat": "Tools"},
    ]  # fmt: skip
    write_lines(tmp_path / "meta_All_Beauty.json.gz", json_lines(meta))
    raw = read_raw(tmp_path, LENIENT)
    assert raw.format == "amazon2018"
    assert raw.interactions[["raw_user_id", "raw_item_id"]].values.tolist() == [["U1", "B1"], ["U1", "B2"]]
    items = raw.items.set_index("raw_item_id")
    assert items.loc["B1", "price"] == 12.99 and items.loc["B1", "description"] == "Gentle soap"
    assert items.loc["B1", "categories"] == ["All Beauty", "Bath"]
    assert math.isnan(items.loc["B2", "price"]) and items.loc["B2", "categories"] == ["Tools"]
    assert raw.rejects[["line", "reason"]].values.tolist() == [[3, "missing_field:unixReviewTime"]]


def test_amazon_2023_milliseconds(tmp_path: Path) -> None:
    reviews = [
        {"rating": 5.0, "title": "t", "text": "x", "images": [], "asin": "C1X", "parent_asin": "C1",
         "user_id": "AGK", "timestamp": 1588687728923, "helpful_vote": 0, "verified_purchase": True},
        {"rating": 4.0, "asin": "C2", "parent_asin": "C2", "user_id": "AGK", "timestamp": 1588687729999},
        {"rating": 4.0, "asin": "C2", "user_id": "B", "timestamp": 1588687729999},
    ]  # fmt: skip
    meta = [
        {"main_category": "All Beauty", "title": "Cream", "description": ["d1", "d2"], "price": None,
         "store": "Howard", "categories": [], "details": {}, "parent_asin": "C1", "bought_together": None},
        {"main_category": "All Beauty", "title": "Gel", "description": [], "price": 8.5, "store": "Lab",
         "categories": ["Beauty", "Hair"], "parent_asin": "C2"},
    ]  # fmt: skip
    write_lines(tmp_path / "All_Beauty.jsonl.gz", json_lines(reviews))
    write_lines(tmp_path / "meta_All_Beauty.jsonl", json_lines(meta))
    raw = read_raw(tmp_path, LENIENT)
    assert raw.format == "amazon2023"
    assert raw.interactions["timestamp"].tolist() == [1588687728, 1588687729]
    assert raw.interactions["raw_item_id"].tolist() == ["C1", "C2"]
    items = raw.items.set_index("raw_item_id")
    assert items.loc["C1", "brand"] == "Howard" and items.loc["C1", "categories"] == ["All Beauty"]
    assert items.loc["C1", "description"] == "d1 d2" and math.isnan(items.loc["C1", "price"])
    assert items.loc["C2", "categories"] == ["Beauty", "Hair"] and items.loc["C2", "price"] == 8.5
    assert raw.rejects["reason"].tolist() == ["missing_field:parent_asin"]


def test_recbole_atomic(tmp_path: Path) -> None:
    write_lines(
        tmp_path / "toy.inter",
        [
            "user_id:token\titem_id:token\trating:float\ttimestamp:float",
            "1\t10\t3\t881250949",
            "1\t11\t4.5\t881250950.0",
            "2\t10\t3",
            "2\t10\t9\t881250951",
            "2\t99\t1\t881250952",
        ],
    )
    write_lines(
        tmp_path / "toy.item",
        [
            "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq",
            "10\tToy Story\t1995\tAnimation Children's Comedy",
            "11\tHeat\t\tAction",
            "10\tDuplicate\t1995\tDrama",
        ],
    )
    raw = read_raw(tmp_path, LENIENT)
    assert raw.format == "recbole"
    assert raw.interactions.values.tolist() == [["1", "10", 881250949, 3.0], ["1", "11", 881250950, 4.5]]
    items = raw.items.set_index("raw_item_id")
    assert items.loc["10", "title"] == "Toy Story"
    assert items.loc["10", "categories"] == ["Animation", "Children's", "Comedy"]
    assert items.loc["10", "description"] == "release_year: 1995" and items.loc["11", "description"] == ""
    reasons = raw.rejects[["line", "reason"]].values.tolist()
    assert reasons == [
        [4, "duplicate_item"],
        [4, "malformed_line"],
        [5, "rating_out_of_range"],
        [6, "unknown_item"],
    ]
    assert raw.rows_read == 5 + 3  # headers are not rows


def test_recbole_without_rating_or_items(tmp_path: Path) -> None:
    write_lines(tmp_path / "x.inter", ["user_id:token\titem_id:token\ttimestamp:float", "a\tb\t5", "a\tc\t6"])
    raw = read_raw(tmp_path)
    assert not raw.has_metadata and raw.items.empty
    assert raw.interactions["rating"].isna().all() and raw.interactions["timestamp"].tolist() == [5, 6]


def test_recbole_header_without_timestamp(tmp_path: Path) -> None:
    write_lines(tmp_path / "x.inter", ["user_id:token\titem_id:token", "a\tb"])
    with pytest.raises(DataQualityError, match=r"x\.inter: line 1 .*\['timestamp'\]"):
        read_raw(tmp_path)


def test_bad_encoding_line_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "x.inter"
    good = "".join(f"u{i}\ti\t{i}\n" for i in range(30))
    path.write_bytes(b"user_id:token\titem_id:token\ttimestamp:float\n" + good.encode() + b"u\xff\ti\t5\n")
    raw = read_raw(tmp_path)
    assert raw.rejects[["line", "reason"]].values.tolist() == [[32, "bad_encoding"]]
    assert len(raw.interactions) == 30


def _inter_file(folder: Path, n_good: int, bad_at: int) -> Path:
    lines = ["user_id:token\titem_id:token\ttimestamp:float"]
    lines += [f"u{i}\ti{i}\t{1000 + i}" for i in range(n_good)]
    lines.insert(bad_at - 1, "u\ti\tnot-a-time")  # bad_at is the 1-based file line
    return write_lines(folder / "data.inter", lines)


def test_reject_share_above_threshold_stops(tmp_path: Path) -> None:
    _inter_file(tmp_path, n_good=9, bad_at=3)  # 1 of 10 rows = 10% > 5%
    with pytest.raises(DataQualityError) as err:
        read_raw(tmp_path)
    message = str(err.value)
    assert "data.inter" in message and "line 3" in message and "bad_timestamp" in message
    assert "1 of 10 rows" in message and "5.0%" in message


def test_reject_share_below_threshold_keeps_rejects(tmp_path: Path) -> None:
    _inter_file(tmp_path, n_good=29, bad_at=3)  # 1 of 30 rows = 3.3% <= 5%
    raw = read_raw(tmp_path)
    assert len(raw.interactions) == 29
    assert raw.rejects.values.tolist() == [
        [str(tmp_path / "data.inter"), 3, "bad_timestamp", "u\ti\tnot-a-time"]
    ]
    with pytest.raises(DataQualityError):
        read_raw(tmp_path, ReadConfig(max_reject_share=0.01))


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("reviews_Beauty_5.json.gz", ("amazon2014", "inter")),
        ("meta_Beauty.json.gz", ("amazon2014/2018", "meta")),
        ("All_Beauty_5.json", ("amazon2018", "inter")),
        ("All_Beauty.jsonl", ("amazon2023", "inter")),
        ("meta_All_Beauty.jsonl.gz", ("amazon2023", "meta")),
        ("ml-100k.inter", ("recbole", "inter")),
        ("ml-100k.item", ("recbole", "meta")),
        ("ml-100k.kg", None),
        (".gitkeep", None),
    ],
)
def test_classify_file(name: str, expected: tuple[str, str] | None) -> None:
    assert classify_file(name) == expected


def test_detect_format_pairs_files(tmp_path: Path) -> None:
    for name in ("reviews_Beauty.json.gz", "meta_Beauty.json.gz", "README.md"):
        write_lines(tmp_path / name, [])
    detected = detect_format(tmp_path)
    assert detected.format == "amazon2014"
    assert [p.name for p in detected.interaction_files] == ["reviews_Beauty.json.gz"]
    assert [p.name for p in detected.metadata_files] == ["meta_Beauty.json.gz"]


def test_detect_mixed_formats(tmp_path: Path) -> None:
    write_lines(tmp_path / "a.inter", [])
    write_lines(tmp_path / "All_Beauty.jsonl", [])
    with pytest.raises(RawFolderError, match=r"mixes several formats \['amazon2023', 'recbole'\]"):
        detect_format(tmp_path)


@pytest.mark.parametrize("state", ["missing", "empty", "meta_only"])
def test_missing_or_empty_folder_message(tmp_path: Path, state: str) -> None:
    folder = tmp_path / "beauty"
    if state != "missing":
        folder.mkdir()
    if state == "meta_only":
        write_lines(folder / "meta_Beauty.json.gz", [])
    with pytest.raises(RawFolderError) as err:
        read_raw(folder)
    message = str(err.value)
    assert str(folder) in message
    assert {"missing": "does not exist", "empty": "is empty", "meta_only": "meta_Beauty.json.gz"}[
        state
    ] in message
    for pattern in (
        "reviews_<Category>.json[.gz]",
        "<Category>.jsonl[.gz]",
        "<name>.inter",
        "meta_<Category>",
    ):
        assert pattern in message


def test_ml100k_falls_back_to_embedded_copy_without_importing_recbole(tmp_path: Path) -> None:
    sys.modules.pop("recbole", None)
    folder = resolve_raw_folder("ml-100k", tmp_path)
    assert folder.parts[-2:] == ("dataset_example", "ml-100k") and (folder / "ml-100k.inter").is_file()
    assert "recbole" not in sys.modules
    local = tmp_path / "ml-100k"
    write_lines(local / "ml-100k.inter", ["user_id:token\titem_id:token\ttimestamp:float", "1\t2\t3"])
    assert resolve_raw_folder("ml-100k", tmp_path) == local
    assert read_dataset("ml-100k", tmp_path).rows_read == 1


def test_other_dataset_names_do_not_fall_back(tmp_path: Path) -> None:
    with pytest.raises(RawFolderError, match="does not exist"):
        read_dataset("beauty", tmp_path)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("$12.99", 12.99), ("$1,299.00 - $1,500.00", 1299.0), ("", math.nan), (None, math.nan), (3, 3.0),
     ("<span>9</span>", math.nan), (-1.0, math.nan)],
)  # fmt: skip
def test_parse_price(value: object, expected: float) -> None:
    got = parse_price(value)
    assert (math.isnan(got) and math.isnan(expected)) or got == expected


def test_a_reject_share_exactly_at_the_threshold_does_not_stop(tmp_path: Path) -> None:
    """The stop is `share > max_reject_share`: 1 of 20 rows (5%) passes 5% and stops at 4.9%."""
    _inter_file(tmp_path, n_good=19, bad_at=3)
    assert len(read_raw(tmp_path, ReadConfig(max_reject_share=0.05)).rejects) == 1
    with pytest.raises(DataQualityError, match="1 of 20 rows rejected"):
        read_raw(tmp_path, ReadConfig(max_reject_share=0.049))
