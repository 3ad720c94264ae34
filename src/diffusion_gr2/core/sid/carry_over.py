"""Semantic IDs carried over from a served model to a retrain's catalogue (warm start:
docs/operations.md#retraining).

A warm start fine-tunes the champion's weights, whose embedding rows are its SID tokens: the
champion's items must keep their SIDs, and a new item must be written with tokens the champion
already has. Items the champion knew (matched by raw item id) keep their four codes. A new item is
placed beside its nearest known item in embedding space: that item's three learned codes, and the
first collision code (4th level) free under them. Only collision codes the champion's vocabulary
holds are used, so every SID is made of existing tokens, and no champion SID is given to another
item (not even one of an item that left the catalogue), so no SID changes meaning. When a
neighbour's group is full the next nearest is tried.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from diffusion_gr2.core.sid.rqvae import uniqueness

__all__ = ["CarriedSids", "carry_over_sids"]


@dataclass(frozen=True)
class CarriedSids:
    """codes: [I, 4] for the new catalogue (row i = item_id i); report: what was kept and placed."""

    codes: np.ndarray
    report: dict[str, float | int | str]


def carry_over_sids(
    items: pd.DataFrame,
    vectors: np.ndarray,
    champion_items: pd.DataFrame,
    champion_sids: pd.DataFrame,
) -> CarriedSids:
    """Codes for `items` (``item_id`` 0..I-1, ``raw_item_id``; `vectors` [I, d] in item_id order).

    `champion_items` / `champion_sids` are the catalogue the champion serves (its own internal ids).
    """
    items = items.sort_values("item_id").reset_index(drop=True)
    if not np.array_equal(items["item_id"].to_numpy(), np.arange(len(items))):
        raise ValueError("items: item_id must be 0..I-1 (the ids data_prep assigns)")
    if len(vectors) != len(items):
        raise ValueError(f"{len(vectors)} item vectors for {len(items)} items")
    old = _champion_codes(champion_items, champion_sids)
    collision_codes = max(c[3] for c in old.values()) + 1  # <d_0> .. <d_n-1> are in its vocabulary

    raw = items["raw_item_id"].astype(str).to_numpy()
    codes = np.full((len(items), 4), -1, dtype=np.int64)
    known = np.array([r in old for r in raw])
    for i in np.flatnonzero(known):
        codes[i] = old[raw[i]]
    used = set(old.values())  # the champion's SIDs, those of items that left included
    if not known.any():
        raise ValueError("no item of the new catalogue is in the champion's: nothing to carry over")

    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    anchors = np.flatnonzero(known)
    for i in np.flatnonzero(~known):
        order = anchors[np.argsort(-(unit[anchors] @ unit[i]), kind="stable")]
        for neighbour in order:
            prefix = tuple(codes[neighbour, :3].tolist())
            free = next((d for d in range(collision_codes) if (*prefix, d) not in used), None)
            if free is not None:
                codes[i] = (*prefix, free)
                used.add((*prefix, free))
                break
        else:
            raise ValueError(
                f"item {raw[i]}: every known SID group is full under the champion's {collision_codes} "
                "collision codes; retrain cold (retrain.warm_start.enabled: false)"
            )
    return CarriedSids(codes, _report(codes, known, len(set(old) - set(raw)), collision_codes))


def _champion_codes(champion_items: pd.DataFrame, champion_sids: pd.DataFrame) -> dict[str, tuple[int, ...]]:
    """The champion's four codes by raw item id; refuses SIDs of any other length."""
    raw_of = dict(zip(champion_items["item_id"], champion_items["raw_item_id"].astype(str), strict=True))
    old = {
        raw_of[int(i)]: tuple(int(c) for c in codes)
        for i, codes in zip(champion_sids["item_id"], champion_sids["codes"], strict=True)
    }
    levels = {len(c) for c in old.values()}
    if levels != {4}:
        raise ValueError(f"champion SIDs must have 4 codes each, found lengths {sorted(levels)}")
    return old


def _report(
    codes: np.ndarray, known: np.ndarray, dropped: int, collision_codes: int
) -> dict[str, float | int | str]:
    """What was kept and placed, in the fields of `fit_semantic_ids`' report."""
    distinct3 = len(np.unique(codes[:, :3], axis=0))
    n = len(codes)
    return {
        # the fields of `fit_semantic_ids`' report, so readers of sid_report.json need no second form
        "levels": 4,
        "codebook_sizes": [int(codes[:, level].max()) + 1 for level in range(4)],
        "uniqueness_3": distinct3 / n,
        "uniqueness_4": uniqueness(codes),
        "collisions_3": n - distinct3,
        "sid_source": "champion",
        "carried": int(known.sum()),
        "placed_new": int((~known).sum()),
        "dropped": dropped,  # champion items no longer in the catalogue (their SIDs stay reserved)
        "collision_codes": collision_codes,
    }
