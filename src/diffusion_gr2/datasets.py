"""Kedro datasets whose writes are atomic: a reader sees the old file or the new one, never half.

Kedro's stock datasets write in place; a crash mid-write would leave a truncated file that the next
``kedro run`` reads. These write to a temporary file beside the target and rename it.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

import pandas as pd
from kedro.io import AbstractDataset, DatasetError

from diffusion_gr2.core.io import atomic_write_json, atomic_write_parquet


class _AtomicFileDataset(AbstractDataset[Any, Any]):
    def __init__(self, filepath: str, metadata: dict[str, Any] | None = None) -> None:
        self._filepath = PurePosixPath(filepath)
        self.metadata = metadata

    @property
    def path(self) -> Path:
        return Path(self._filepath)

    def _describe(self) -> dict[str, Any]:
        return {"filepath": str(self._filepath)}

    def _exists(self) -> bool:
        return self.path.exists()

    def _missing(self) -> DatasetError:
        return DatasetError(f"{self.path} does not exist: run the pipeline stage that writes it first")


class AtomicJSONDataset(_AtomicFileDataset):
    """A JSON report (``data/08_reporting/*.json``) written atomically."""

    def load(self) -> Any:
        if not self.path.exists():
            raise self._missing()
        return json.loads(self.path.read_text())

    def save(self, data: Any) -> None:
        atomic_write_json(self.path, data)


class AtomicParquetDataset(_AtomicFileDataset):
    """A pandas frame stored as parquet, written atomically."""

    def load(self) -> pd.DataFrame:
        if not self.path.exists():
            raise self._missing()
        return pd.read_parquet(self.path)

    def save(self, data: pd.DataFrame) -> None:
        atomic_write_parquet(data, self.path)
