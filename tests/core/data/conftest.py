"""Helpers that write raw fixture files in the exact formats of the public dumps."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from diffusion_gr2.core.data.raw import RawDataset, Rejects, build_raw_dataset


def write_lines(path: Path, lines: Sequence[str]) -> Path:
    """Write ``lines`` (newline-terminated) as plain text, or gzip when the name ends with ``.gz``."""
    data = "".join(f"{line}\n" for line in lines).encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wb") as handle:
            handle.write(data)
    else:
        path.write_bytes(data)
    return path


def json_lines(records: Sequence[dict[str, Any]]) -> list[str]:
    return [json.dumps(record) for record in records]


@pytest.fixture
def make_raw() -> Callable[..., RawDataset]:
    """Build a `RawDataset` from ``(user, item, timestamp)`` rows (file order = list order)."""

    def build(rows: Sequence[tuple[Any, Any, int]], items: pd.DataFrame | None = None) -> RawDataset:
        interactions = [(str(u), str(i), int(t), 4.0) for u, i, t in rows]
        item_rows = [] if items is None else list(items.itertuples(index=False, name=None))
        rejects = Rejects(rows_by_file={"mem": len(rows)})
        return build_raw_dataset(
            interactions, item_rows, rejects, "test", "mem", has_metadata=items is not None
        )

    return build
