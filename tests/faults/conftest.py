"""Builders of bad inputs for the fault-injection suite: raw folders with one bad line among good ones.

Every case writes its input on the fly. A folder holds ``GOOD`` good interactions (and metadata for
every item they use); the bad line goes in at ``BAD_LINE`` of the named file, so a case can assert
the exact reject (file, line, reason) and that every good row is still there.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

GOOD = 8  # good interaction rows in every raw fixture
BAD_LINE = 3  # 1-based data line where the bad line is inserted (after the header, if any)
BASE_TIME = 1_390_000_000


@dataclass(frozen=True)
class RawLayout:
    """One raw format: its file names and how a good review / metadata line is written."""

    reviews: str
    meta: str
    header_inter: str | None = None
    header_item: str | None = None

    def review(self, k: int) -> str:
        item = f"I{k % 4}"
        if self.header_inter is not None:  # RecBole atomic
            return f"u{k}\t{item}\t4\t{BASE_TIME + k}"
        if self.reviews.endswith(".jsonl"):  # 2023: milliseconds, parent_asin
            record = {
                "user_id": f"u{k}",
                "parent_asin": item,
                "rating": 4.0,
                "timestamp": (BASE_TIME + k) * 1000,
            }
            return json.dumps(record)
        return json.dumps(
            {"reviewerID": f"u{k}", "asin": item, "overall": 4.0, "unixReviewTime": BASE_TIME + k}
        )

    def item(self, k: int) -> str:
        if self.header_item is not None:
            return f"I{k}\tTitle {k}\tDrama Comedy"
        key = "parent_asin" if self.meta.endswith(".jsonl") else "asin"
        return json.dumps({key: f"I{k}", "title": f"Title {k}", "categories": [["Beauty", "Skin"]]})


AMAZON_2014 = RawLayout("reviews_Beauty_5.json", "meta_Beauty.json")
AMAZON_2023 = RawLayout("All_Beauty.jsonl", "meta_All_Beauty.jsonl")
RECBOLE = RawLayout(
    "toy.inter",
    "toy.item",
    header_inter="user_id:token\titem_id:token\trating:float\ttimestamp:float",
    header_item="item_id:token\tmovie_title:token_seq\tclass:token_seq",
)


def write_bytes(path: Path, lines: list[bytes]) -> Path:
    data = b"".join(line + b"\n" for line in lines)
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def raw_folder(
    folder: Path, layout: RawLayout, bad: bytes | str | None = None, in_meta: bool = False
) -> Path:
    """Write ``layout``'s two files under ``folder`` with ``bad`` at data line ``BAD_LINE`` of one of them.

    Returns the path of the file holding the bad line.
    """
    folder.mkdir(parents=True, exist_ok=True)
    reviews = [layout.review(k).encode() for k in range(GOOD)]
    items = [layout.item(k).encode() for k in range(4)]
    target = items if in_meta else reviews
    if bad is not None:
        target.insert(BAD_LINE - 1, bad.encode() if isinstance(bad, str) else bad)
    for name, header, lines in (
        (layout.reviews, layout.header_inter, reviews),
        (layout.meta, layout.header_item, items),
    ):
        write_bytes(folder / name, ([header.encode()] if header else []) + lines)
    return folder / (layout.meta if in_meta else layout.reviews)
