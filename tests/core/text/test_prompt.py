from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from diffusion_gr2.core.text.prompt import (
    ItemLookup,
    PromptConfig,
    build_messages,
    item_line,
    render_answer,
    short_title,
    split_sid,
)


def _user_lines(messages: list[dict[str, str]]) -> list[str]:
    return messages[1]["content"].split("\n")


def test_messages_show_recent_history_then_candidates_in_order(lookup: ItemLookup) -> None:
    history = list(range(15))
    candidates = [30, 20, 40, 25]
    messages = build_messages(history, candidates, lookup, PromptConfig(history_in_prompt=10))
    assert [m["role"] for m in messages] == ["system", "user"]
    lines = _user_lines(messages)
    hist_lines = lines[1:11]
    assert [ln.split(" ", 1)[0] for ln in hist_lines] == lookup.sids(range(5, 15))  # most recent last
    assert lines[11] == "Candidates (4):"
    assert [ln.split(" ", 1)[0] for ln in lines[12:]] == lookup.sids(candidates)  # pre-rank order kept
    assert lookup[0].sid not in messages[1]["content"]  # older history is dropped


def test_short_history_and_no_scores_shown(lookup: ItemLookup) -> None:
    messages = build_messages([3, 4], [5, 6], lookup, PromptConfig())
    lines = _user_lines(messages)
    assert len(lines) == 1 + 2 + 1 + 2
    assert "score" not in messages[1]["content"].lower()
    assert "target" not in messages[1]["content"].lower()


def _frames() -> tuple[pd.DataFrame, pd.DataFrame]:
    items = pd.DataFrame(
        {
            "item_id": [0, 1, 2, 3],
            "raw_item_id": ["a", "b", "c", "d"],
            "title": ["One two three four five six seven eight", "Lip | Gloss", "x", float("nan")],
            "categories": [
                np.array(["Beauty", "Skin Care", "Face", "Creams"]),  # arrays, as parquet returns them
                ["Beauty", "Makeup", "Lips"],
                ["Beauty"],
                ["Beauty", "Makeup"],
            ],
            "brand": ["Acme", "", "Zed", ""],
            "price": [12.5, float("nan"), -1.0, 3.0],
            "description": ["", "", "", ""],
        }
    )
    sids = pd.DataFrame(
        {
            "item_id": [0, 1, 2],  # item 3 has no SID
            "codes": [[1, 2, 3, 4], [1, 2, 3, 5], [2, 2, 3, 4]],
            "sid": ["<a_1><b_2><c_3><d_4>", "<a_1><b_2><c_3><d_5>", "<a_2><b_2><c_3><d_4>"],
        }
    )
    return items, sids


def test_lookup_from_frames_shortens_and_drops_common_categories() -> None:
    items, sids = _frames()
    lookup = ItemLookup.from_frames(items, sids, PromptConfig(title_words=6, max_categories=2))
    assert 3 not in lookup and len(lookup.items) == 3
    first = lookup[0]
    assert first.title == "One two three four five six"
    assert first.categories == ("Skin Care", "Face")  # "Beauty" is on every item: dropped
    assert lookup[1].title == "Lip / Gloss"  # the field separator never appears inside a field
    assert math.isnan(lookup[2].price)  # a negative price is treated as missing
    assert lookup.item_ids(["<a_1><b_2><c_3><d_5>"]) == [1]


def test_candidate_line_has_offer_only_where_present() -> None:
    items, sids = _frames()
    lookup = ItemLookup.from_frames(items, sids, PromptConfig(title_words=6))
    assert (
        item_line(lookup[0], with_offer=True)
        == "<a_1><b_2><c_3><d_4> One two three four five six | Skin Care, Face | Acme, $12.50"
    )
    assert item_line(lookup[1], with_offer=True) == "<a_1><b_2><c_3><d_5> Lip / Gloss | Makeup, Lips"
    assert item_line(lookup[0], with_offer=False).count("|") == 1
    assert item_line(lookup[2], with_offer=True) == "<a_2><b_2><c_3><d_4> x | - | Zed"


def test_render_answer_is_compact_json() -> None:
    ranking = ["<a_1><b_2><c_3><d_4>", "<a_2><b_2><c_3><d_4>"]
    text = render_answer('Likes "Face" créme', ranking)
    assert text.startswith('{"explanation":"Likes \\"Face\\" créme","recommendations":["<a_1>')
    assert ", " not in text.split('"recommendations"')[1]
    assert json.loads(text) == {"explanation": 'Likes "Face" créme', "recommendations": ranking}


def test_helpers() -> None:
    assert split_sid("<a_12><b_7><c_21><d_3>") == ["<a_12>", "<b_7>", "<c_21>", "<d_3>"]
    assert short_title("  ", 3) == "untitled"
    with pytest.raises(ValueError):
        PromptConfig(history_in_prompt=0)
