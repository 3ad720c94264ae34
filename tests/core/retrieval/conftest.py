"""Synthetic `splits` frames shaped like the contract (docs/architecture.md), with a learnable pattern."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch


def cyclic_splits(num_users: int, num_items: int, min_len: int, max_len: int, seed: int = 0) -> pd.DataFrame:
    """Every user walks a fixed item cycle from a random start: the next item is the cycle successor.

    A sequential model can learn this exactly; popularity cannot (all items are about equally popular).
    """
    rng = np.random.default_rng(seed)
    cycle = rng.permutation(num_items)
    rows = []
    for user in range(num_users):
        start, length = rng.integers(num_items), rng.integers(min_len, max_len + 1)
        seq = [int(cycle[(start + k) % num_items]) for k in range(length)]
        stamps = list(range(1000 * user, 1000 * user + length))
        rows.append(
            {
                "user_id": user,
                "train_items": seq[:-2],
                "train_timestamps": stamps[:-2],
                "valid_item": seq[-2],
                "valid_timestamp": stamps[-2],
                "valid_items": seq[-2:-1],
                "valid_timestamps": stamps[-2:-1],
                "test_item": seq[-1],
                "test_timestamp": stamps[-1],
                "test_items": seq[-1:],
                "test_timestamps": stamps[-1:],
            }
        )
    return pd.DataFrame(rows).astype({"user_id": "int64", "valid_item": "int64", "test_item": "int64"})


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture
def small_splits() -> pd.DataFrame:
    return cyclic_splits(num_users=40, num_items=30, min_len=5, max_len=12)
