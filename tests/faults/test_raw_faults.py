"""Bad raw lines: each is a counted reject with its reason, and every good row is kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffusion_gr2.core.data.raw import ReadConfig
from diffusion_gr2.core.data.readers import read_raw

from .conftest import AMAZON_2014, AMAZON_2023, BAD_LINE, BASE_TIME, GOOD, RECBOLE, RawLayout, raw_folder

LENIENT = ReadConfig(max_reject_share=None)  # the share rule has its own cases (test_file_faults)


def review(**fields: object) -> str:
    """A 2014 review line: a good one with ``fields`` replaced (``...`` drops a field)."""
    record: dict[str, object] = {
        "reviewerID": "uX",
        "asin": "I1",
        "overall": 4.0,
        "unixReviewTime": BASE_TIME,
    }
    record.update(fields)
    return json.dumps({k: v for k, v in record.items() if v is not ...})


def meta(**fields: object) -> str:
    """A 2014 metadata line for a new item ``IX`` (no review uses it) with ``fields`` replaced."""
    record: dict[str, object] = {"asin": "IX", "title": "Extra", "categories": [["Beauty"]]}
    record.update(fields)
    return repr({k: v for k, v in record.items() if v is not ...})  # Python literal, as in the 2014 dump


# (case id, layout, bad line, in the metadata file?, expected reason)
CASES: list[tuple[str, RawLayout, str | bytes, bool, str]] = [
    ("truncated_json", AMAZON_2014, '{"reviewerID": "u1", "asin": ', False, "malformed_json"),
    ("json_array", AMAZON_2014, "[1, 2, 3]", False, "malformed_json"),
    ("int_5000_digits", AMAZON_2014, review().replace(str(BASE_TIME), "9" * 5000), False, "malformed_json"),
    ("deep_nesting", AMAZON_2014, "[" * 100_000 + "]" * 100_000, False, "malformed_json"),
    ("int_400_digits_time", AMAZON_2014, review(unixReviewTime=10**400), False, "bad_timestamp"),
    ("time_1e400", AMAZON_2014, review().replace(str(BASE_TIME), "1e400"), False, "bad_timestamp"),
    ("time_negative", AMAZON_2014, review(unixReviewTime=-5), False, "bad_timestamp"),
    ("time_year_3000", AMAZON_2014, review(unixReviewTime=32_503_680_000), False, "bad_timestamp"),
    ("time_text", AMAZON_2014, review(unixReviewTime="yesterday"), False, "bad_timestamp"),
    ("time_bool", AMAZON_2014, review(unixReviewTime=True), False, "bad_timestamp"),
    ("rating_1e400", AMAZON_2014, review().replace("4.0", "1e400"), False, "bad_rating"),
    ("rating_nan", AMAZON_2014, review(overall=float("nan")), False, "bad_rating"),
    ("rating_huge_int", AMAZON_2014, review(overall=10**400), False, "rating_out_of_range"),
    ("rating_7", AMAZON_2014, review(overall=7), False, "rating_out_of_range"),
    ("rating_text", AMAZON_2014, review(overall="five"), False, "bad_rating"),
    ("missing_item", AMAZON_2014, review(asin=...), False, "missing_field:asin"),
    ("null_user", AMAZON_2014, review(reviewerID=None), False, "missing_field:reviewerID"),
    ("blank_user", AMAZON_2014, review(reviewerID="  "), False, "missing_field:reviewerID"),
    ("dict_user", AMAZON_2014, review(reviewerID={"id": 1}), False, "bad_id:reviewerID"),
    ("float_item", AMAZON_2014, review(asin=1.5), False, "bad_id:asin"),
    ("surrogate_user", AMAZON_2014, review(reviewerID="\ud800"), False, "bad_text:reviewerID"),
    ("unknown_item", AMAZON_2014, review(asin="NOPE"), False, "unknown_item"),
    ("duplicate_key", AMAZON_2014, review()[:-1] + ', "overall": 1.0}', False, "duplicate_key"),
    ("bad_utf8", AMAZON_2014, b'{"reviewerID": "u\xff"}', False, "bad_encoding"),
    ("categories_int", AMAZON_2014, meta(categories=3), True, "bad_field:categories"),
    ("categories_dict", AMAZON_2014, meta(categories={"a": "b"}), True, "bad_field:categories"),
    ("categories_null_in_list", AMAZON_2014, meta(categories=["x", None, 3]), True, "bad_field:categories"),
    ("categories_nested_int", AMAZON_2014, meta(categories=[["x", 3]]), True, "bad_field:categories"),
    ("title_dict", AMAZON_2014, meta(title={"en": "x"}), True, "bad_field:title"),
    ("description_null_in_list", AMAZON_2014, meta(description=["a", None]), True, "bad_field:description"),
    ("title_surrogate", AMAZON_2014, '{"asin": "IX", "title": "bad \\ud800 title"}', True, "bad_text:title"),
    ("meta_missing_asin", AMAZON_2014, meta(asin=...), True, "missing_field:asin"),
    ("meta_duplicate_item", AMAZON_2014, meta(asin="I0"), True, "duplicate_item"),
    ("meta_not_a_literal", AMAZON_2014, "{'asin': 'IX', 'title': ", True, "malformed_json"),
    ("meta_code_not_literal", AMAZON_2014, "__import__('os').getcwd()", True, "malformed_json"),
    ("meta_2023_categories_int", AMAZON_2023, '{"parent_asin": "IX", "categories": 3}', True, "bad_field:categories"),
    ("review_2023_missing_parent", AMAZON_2023, '{"user_id": "u", "rating": 4, "timestamp": 1}', False,
     "missing_field:parent_asin"),
    ("recbole_short_line", RECBOLE, "u9\tI1\t4", False, "malformed_line"),
    ("recbole_blank_time", RECBOLE, "u9\tI1\t4\t ", False, "missing_field:timestamp"),
    ("recbole_time_inf", RECBOLE, "u9\tI1\t4\t1e400", False, "bad_timestamp"),
    ("recbole_rating_0", RECBOLE, f"u9\tI1\t0\t{BASE_TIME}", False, "rating_out_of_range"),
    ("recbole_unknown_item", RECBOLE, f"u9\tNOPE\t4\t{BASE_TIME}", False, "unknown_item"),
    ("recbole_item_short_line", RECBOLE, "IX\tno class column", True, "malformed_line"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("layout", "bad", "in_meta", "reason"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_line_is_a_counted_reject_and_good_rows_stay(
    tmp_path: Path, layout: RawLayout, bad: str | bytes, in_meta: bool, reason: str
) -> None:
    bad_file = raw_folder(tmp_path, layout, bad, in_meta)
    raw = read_raw(tmp_path, LENIENT)
    header = 1 if (layout.header_item if in_meta else layout.header_inter) else 0
    assert raw.rejects[["file", "line", "reason"]].values.tolist() == [
        [str(bad_file), BAD_LINE + header, reason]
    ]
    assert raw.rejected_by_reason() == {reason: 1}
    assert len(raw.interactions) == GOOD and raw.rows_read == GOOD + 4 + 1  # all good rows kept and counted
    assert len(raw.items) == 4


@pytest.mark.parametrize(
    ("layout", "stamp", "expected"),
    [
        (AMAZON_2023, (BASE_TIME + 5) * 1000, BASE_TIME + 5),  # the release's milliseconds
        (AMAZON_2023, BASE_TIME + 5, BASE_TIME + 5),  # re-exported in seconds: not 1970
        (AMAZON_2014, (BASE_TIME + 5) * 1000, BASE_TIME + 5),  # milliseconds where seconds are usual
        (RECBOLE, f"{BASE_TIME + 5}.0", BASE_TIME + 5),
    ],
    ids=["2023_ms", "2023_seconds", "2014_ms", "recbole_float_seconds"],
)
def test_timestamp_unit_is_read_off_the_value(
    tmp_path: Path, layout: RawLayout, stamp: object, expected: int
) -> None:
    if layout is RECBOLE:
        line = f"u9\tI1\t4\t{stamp}"
    elif layout is AMAZON_2023:
        line = json.dumps({"user_id": "u9", "parent_asin": "I1", "rating": 4.0, "timestamp": stamp})
    else:
        line = review(reviewerID="u9", unixReviewTime=stamp)
    raw_folder(tmp_path, layout, line)
    raw = read_raw(tmp_path)
    assert raw.rejects.empty
    got = raw.interactions.set_index("raw_user_id").loc["u9", "timestamp"]
    assert got == expected and raw.interactions["timestamp"].min() >= BASE_TIME  # nothing in 1970
