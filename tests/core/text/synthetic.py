"""Small synthetic frames shaped like MovieLens-100k (`items`, `sids`, `candidates`) for text tests."""

from __future__ import annotations

import numpy as np
import pandas as pd

GENRES = (
    "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
    "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War",
    "Western",
)  # fmt: skip
TITLES = (
    "Toy Story", "GoldenEye", "Four Rooms", "Get Shorty", "Copycat", "Twelve Monkeys", "Babe",
    "Dead Man Walking", "Richard III", "Seven (Se7en)", "Usual Suspects, The", "Mighty Aphrodite",
    "Postino, Il", "Mr. Holland's Opus", "French Twist (Gazon maudit)", "From Dusk Till Dawn",
    "White Balloon, The", "Antonia's Line", "Angels and Insects", "Muppet Treasure Island", "Braveheart",
    "Taxi Driver", "Rumble in the Bronx", "Birdcage, The", "Brothers McMullen, The", "Bad Boys",
    "Apollo 13", "Batman Forever", "Belle de jour", "Crimson Tide", "Crumb", "Desperado",
    "Doom Generation, The", "Free Willy 2: The Adventure Home", "Mad Love", "Nadja", "Net, The",
    "Strange Days", "To Wong Foo, Thanks for Everything! Julie Newmar", "Billy Madison", "Clerks",
    "Disclosure", "Dolores Claiborne", "Eat Drink Man Woman", "Exotica", "Ed Wood", "Hoop Dreams",
    "I.Q.", "Star Wars", "Legends of the Fall", "Madness of King George, The", "Natural Born Killers",
)  # fmt: skip
SID_LEVELS = ("a", "b", "c", "d")
SID_SIZES = (16, 16, 16, 4)  # codebook size per level


def sid_tokens() -> list[str]:
    """All SID tokens of the synthetic codebooks."""
    return [f"<{lv}_{c}>" for lv, size in zip(SID_LEVELS, SID_SIZES, strict=True) for c in range(size)]


def make_items(n_items: int, seed: int, with_offers: bool = False) -> pd.DataFrame:
    """`items` frame: MovieLens titles and 1-3 genres; brand/price only when `with_offers`."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n_items):
        genres = list(rng.choice(GENRES, size=int(rng.integers(1, 4)), replace=False))
        rows.append(
            {
                "item_id": i,
                "raw_item_id": str(i + 1),
                "title": str(TITLES[i % len(TITLES)])
                + ("" if i < len(TITLES) else f" {i // len(TITLES) + 1}"),
                "categories": [str(g) for g in genres],
                "brand": f"Brand{int(rng.integers(0, 5))}" if with_offers else "",
                "price": float(np.round(rng.uniform(3, 60), 2)) if with_offers else float("nan"),
                "description": "",
            }
        )
    return pd.DataFrame(rows)


def make_sids(n_items: int, seed: int) -> pd.DataFrame:
    """`sids` frame: unique random 4-level codes."""
    rng = np.random.default_rng(seed)
    seen: set[tuple[int, ...]] = set()
    codes = []
    while len(codes) < n_items:
        code = tuple(int(rng.integers(0, s)) for s in SID_SIZES)
        if code not in seen:
            seen.add(code)
            codes.append(list(code))
    sids = ["".join(f"<{lv}_{c}>" for lv, c in zip(SID_LEVELS, code, strict=True)) for code in codes]
    return pd.DataFrame({"item_id": range(n_items), "codes": codes, "sid": sids})


def make_candidates(
    items: pd.DataFrame, n_users: int, seed: int, history_len: int = 12, n_candidates: int = 10
) -> pd.DataFrame:
    """`candidates` frame: users who favour two genres; the target is drawn like the history.

    The target is placed at a random pre-rank position (1..N) among random negatives.
    """
    rng = np.random.default_rng(seed)
    n_items = len(items)
    genres = items["categories"].tolist()
    rows = []
    for user in range(n_users):
        liked = set(rng.choice(GENRES, size=2, replace=False))
        affinity = np.array([1.0 + 4.0 * len(liked & set(g)) for g in genres])
        seq = rng.choice(n_items, size=history_len + 1, replace=False, p=affinity / affinity.sum())
        history, target = [int(i) for i in seq[:-1]], int(seq[-1])
        pool = np.setdiff1d(np.arange(n_items), seq)
        cands = [int(i) for i in rng.choice(pool, size=n_candidates - 1, replace=False)]
        position = int(rng.integers(0, n_candidates))
        cands.insert(position, target)
        rows.append(
            {
                "user_id": user,
                "split": "train",
                "point": 0,  # one request per user and split
                "history": history,
                "target": target,
                "candidates": cands,
                "target_position": position + 1,
            }
        )
    return pd.DataFrame(rows)
