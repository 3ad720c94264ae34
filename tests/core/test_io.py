"""Atomic writes: the old artifact survives any failure mid-write, and no temp file is left behind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from diffusion_gr2.core.io import (
    atomic_directory,
    atomic_write_json,
    atomic_write_parquet,
    atomic_write_text,
)


def _siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_json_round_trip_with_numpy(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "stats.json"
    atomic_write_json(path, {"users": np.int64(3), "share": np.float32(0.5), "ids": np.arange(2)})
    assert json.loads(path.read_text()) == {"users": 3, "share": 0.5, "ids": [0, 1]}
    assert _siblings(path.parent) == ["stats.json"]


def test_json_unserialisable_leaves_old_file(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    atomic_write_json(path, {"a": 1})
    with pytest.raises(TypeError):
        atomic_write_json(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}
    assert _siblings(tmp_path) == ["stats.json"]


def test_parquet_round_trip(tmp_path: Path) -> None:
    df = pd.DataFrame({"user_id": [0, 1], "items": [[1, 2], [3]]})
    path = atomic_write_parquet(df, tmp_path / "x.parquet")
    back = pd.read_parquet(path)
    assert back["user_id"].tolist() == [0, 1]
    assert [list(v) for v in back["items"]] == [[1, 2], [3]]


def test_failure_mid_write_keeps_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "x.parquet"
    atomic_write_parquet(pd.DataFrame({"a": [1, 2, 3]}), path)

    def explode(self: pd.DataFrame, handle: Any, **kwargs: Any) -> None:
        handle.write(b"PAR1 half written")
        raise OSError("disk full")

    monkeypatch.setattr(pd.DataFrame, "to_parquet", explode)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_parquet(pd.DataFrame({"a": [9]}), path)
    monkeypatch.undo()
    assert pd.read_parquet(path)["a"].tolist() == [1, 2, 3]
    assert _siblings(tmp_path) == ["x.parquet"]


def test_text_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    atomic_write_text(path, "one")
    atomic_write_text(path, "two ✓")
    assert path.read_text(encoding="utf-8") == "two ✓"


def test_atomic_directory_replaces_old(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    with atomic_directory(target) as tmp:
        (tmp / "weights.bin").write_bytes(b"v1")
        (tmp / "stale.txt").write_text("only in v1")
    with atomic_directory(target) as tmp:
        assert tmp != target and tmp.parent == tmp_path
        assert (target / "weights.bin").read_bytes() == b"v1"  # old still intact during write
        (tmp / "weights.bin").write_bytes(b"v2")
    assert (target / "weights.bin").read_bytes() == b"v2"
    assert not (target / "stale.txt").exists()
    assert _siblings(tmp_path) == ["ckpt"]


def test_atomic_directory_failure_keeps_old(tmp_path: Path) -> None:
    target = tmp_path / "model"
    with atomic_directory(target) as tmp:
        (tmp / "config.json").write_text("{}")
    with pytest.raises(RuntimeError), atomic_directory(target) as tmp:
        (tmp / "config.json").write_text('{"half": ')
        raise RuntimeError("crash mid-save")
    assert (target / "config.json").read_text() == "{}"
    assert _siblings(tmp_path) == ["model"]


def test_atomic_directory_failure_without_old(tmp_path: Path) -> None:
    target = tmp_path / "new"
    with pytest.raises(ValueError), atomic_directory(target):
        raise ValueError("boom")
    assert _siblings(tmp_path) == []
