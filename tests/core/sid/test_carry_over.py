"""Warm start keeps the champion's SIDs and writes new items with tokens it already has."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from diffusion_gr2.core.sid.carry_over import carry_over_sids
from diffusion_gr2.core.sid.rqvae import sids_frame

CHAMPION_ITEMS = pd.DataFrame({"item_id": range(5), "raw_item_id": [str(r) for r in range(100, 105)]})


def _sids(fourth: list[int]) -> pd.DataFrame:
    """Champion SIDs of raw 100..104; 100 and 101 share the learned codes (1, 2, 3)."""
    prefixes = [[1, 2, 3], [1, 2, 3], [4, 5, 6], [7, 8, 9], [4, 5, 7]]
    return sids_frame(np.array([[*p, d] for p, d in zip(prefixes, fourth, strict=True)]))


def test_known_items_keep_their_codes_and_new_ones_sit_beside_their_nearest_neighbour() -> None:
    # the new catalogue renumbers: raw 104 and 100 first, 101 left, 200 and 201 are new
    items = pd.DataFrame({"item_id": range(6), "raw_item_id": ["104", "100", "200", "102", "103", "201"]})
    vectors = np.eye(6)
    vectors[2] = vectors[1] + 0.5 * vectors[3] + 0.1 * vectors[2]  # nearest raw 100, then raw 102
    vectors[5] = vectors[4] + 0.1 * vectors[5]  # nearest raw 103
    out = carry_over_sids(items, vectors, CHAMPION_ITEMS, _sids([0, 1, 0, 0, 0]))

    assert [out.codes[i].tolist() for i in (0, 1, 3, 4)] == [
        [4, 5, 7, 0],
        [1, 2, 3, 0],
        [4, 5, 6, 0],
        [7, 8, 9, 0],
    ]
    # raw 100's group is full: <d_1> still belongs to raw 101 (gone, but its SID keeps its meaning)
    assert out.codes[2].tolist() == [4, 5, 6, 1]
    assert out.codes[5].tolist() == [7, 8, 9, 1]
    assert len({tuple(c) for c in out.codes.tolist()}) == 6
    assert out.codes[:, 3].max() < 2  # only collision tokens the champion's vocabulary holds
    assert {k: out.report[k] for k in ("carried", "placed_new", "dropped", "collision_codes")} == {
        "carried": 4,
        "placed_new": 2,
        "dropped": 1,
        "collision_codes": 2,
    }
    assert out.report["uniqueness_4"] == 1.0 and out.report["codebook_sizes"] == [8, 9, 10, 2]


def test_a_new_item_whose_known_neighbours_are_all_full_is_refused_by_name() -> None:
    # only raw 100 is known, and its group (1, 2, 3) holds both of the champion's collision codes
    items = pd.DataFrame({"item_id": range(2), "raw_item_id": ["100", "300"]})
    with pytest.raises(ValueError, match="item 300: every known SID group is full"):
        carry_over_sids(items, np.eye(2), CHAMPION_ITEMS, _sids([0, 1, 0, 0, 0]))


def test_a_catalogue_with_no_known_item_is_refused() -> None:
    items = pd.DataFrame({"item_id": [0], "raw_item_id": ["999"]})
    with pytest.raises(ValueError, match="no item of the new catalogue"):
        carry_over_sids(items, np.ones((1, 3)), CHAMPION_ITEMS, _sids([0, 1, 0, 0, 0]))
