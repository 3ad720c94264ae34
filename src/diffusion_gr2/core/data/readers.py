"""Raw data entry point: detect the format of a raw folder and read it into a `RawDataset`.

Formats are recognised from file names (docs/architecture.md#data):

* ``amazon2014``: ``reviews_<Cat>.json[.gz]`` + ``meta_<Cat>.json[.gz]`` (Python dict literals)
* ``amazon2018``: ``<Cat>.json[.gz]`` + ``meta_<Cat>.json[.gz]``
* ``amazon2023``: ``<Cat>.jsonl[.gz]`` + ``meta_<Cat>.jsonl[.gz]`` (timestamps in milliseconds)
* ``recbole``: ``<name>.inter`` + optional ``<name>.item``

The dataset name ``ml-100k`` falls back to the copy embedded in the recbole wheel when
``data/01_raw/ml-100k/`` holds no data files.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from diffusion_gr2.core.data.amazon import read_amazon
from diffusion_gr2.core.data.raw import DataQualityError, RawDataset, ReadConfig, check_reject_share
from diffusion_gr2.core.data.recbole import EMBEDDED_DATASET, embedded_ml100k_folder, read_recbole

logger = logging.getLogger(__name__)

__all__ = [
    "DataQualityError",
    "DetectedFiles",
    "RawDataset",
    "RawFolderError",
    "ReadConfig",
    "detect_format",
    "read_dataset",
    "read_interactions",
    "read_raw",
    "resolve_raw_folder",
]

EXPECTED_PATTERNS = {
    "amazon2014": "reviews_<Category>.json[.gz] + meta_<Category>.json[.gz]",
    "amazon2018": "<Category>.json[.gz] (e.g. All_Beauty.json.gz) + meta_<Category>.json[.gz]",
    "amazon2023": "<Category>.jsonl[.gz] (e.g. All_Beauty.jsonl) + meta_<Category>.jsonl[.gz]",
    "recbole": "<name>.inter + optional <name>.item (RecBole atomic files)",
}
_AMAZON_JSON_META = "amazon2014/2018"  # meta_*.json is shared by the 2014 and 2018 releases


class RawFolderError(FileNotFoundError):
    """The raw folder is missing, empty, or holds no recognisable (or several) formats."""


@dataclass(frozen=True)
class DetectedFiles:
    """The format of a raw folder and its files, each list in sorted name order."""

    format: str
    interaction_files: list[Path]
    metadata_files: list[Path]


def classify_file(name: str) -> tuple[str, str] | None:
    """``(format, "inter" | "meta")`` from a file name, or None for files no reader uses."""
    if name.startswith("."):
        return None
    if name.endswith(".inter"):
        return "recbole", "inter"
    if name.endswith(".item"):
        return "recbole", "meta"
    base = name.removesuffix(".gz")
    if base.endswith(".jsonl"):
        return ("amazon2023", "meta") if base.startswith("meta_") else ("amazon2023", "inter")
    if base.endswith(".json"):
        if base.startswith("meta_"):
            return _AMAZON_JSON_META, "meta"
        return ("amazon2014", "inter") if base.startswith("reviews_") else ("amazon2018", "inter")
    return None


def _folder_error(folder: Path, problem: str) -> RawFolderError:
    expected = "\n".join(f"  {fmt}: {pattern}" for fmt, pattern in EXPECTED_PATTERNS.items())
    return RawFolderError(f"Raw data folder {folder} {problem}. Expected files of one format:\n{expected}")


def _classified(folder: Path) -> dict[tuple[str, str], list[Path]]:
    if not folder.is_dir():
        raise _folder_error(folder, "does not exist")
    groups: dict[tuple[str, str], list[Path]] = {}
    for path in sorted(folder.iterdir()):
        kind = classify_file(path.name) if path.is_file() else None
        if kind is not None:
            groups.setdefault(kind, []).append(path)
    return groups


def detect_format(folder: Path | str) -> DetectedFiles:
    """Recognise the single raw format in ``folder`` from its file names."""
    folder = Path(folder)
    groups = _classified(folder)
    formats = sorted({fmt for fmt, role in groups if role == "inter"})
    if not formats:
        names = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
        problem = f"holds no interaction file (found: {names})" if names else "is empty"
        raise _folder_error(folder, problem)
    if len(formats) > 1:
        raise _folder_error(folder, f"mixes several formats {formats}; keep one format per folder")
    fmt = formats[0]
    meta_key = _AMAZON_JSON_META if fmt in ("amazon2014", "amazon2018") else fmt
    # Metadata of another release would be skipped, leaving every title empty: refuse it instead.
    stray = sorted(
        p.name for (kind, role), paths in groups.items() if role == "meta" and kind != meta_key for p in paths
    )
    if stray:
        raise _folder_error(
            folder, f"holds {fmt} interaction files but metadata file(s) {stray} of another format"
        )
    return DetectedFiles(fmt, groups[(fmt, "inter")], groups.get((meta_key, "meta"), []))


def has_data_files(folder: Path) -> bool:
    """True when ``folder`` exists and holds at least one interaction file of a known format."""
    return folder.is_dir() and any(
        path.is_file() and (classify_file(path.name) or ("", ""))[1] == "inter" for path in folder.iterdir()
    )


def resolve_raw_folder(dataset: str, raw_root: Path | str = "data/01_raw") -> Path:
    """The folder holding ``dataset``; ``ml-100k`` falls back to the copy inside the recbole wheel."""
    folder = Path(raw_root) / dataset
    if dataset == EMBEDDED_DATASET and not has_data_files(folder):
        embedded = embedded_ml100k_folder()
        logger.info(
            "%s has no data files; using the MovieLens-100k embedded in recbole: %s", folder, embedded
        )
        return embedded
    return folder


def read_raw(folder: Path | str, config: ReadConfig | None = None) -> RawDataset:
    """Detect the format of ``folder`` and read it; raises `DataQualityError` above the reject share."""
    folder, config = Path(folder), config or ReadConfig()
    detected = detect_format(folder)
    logger.info(
        "reading %s as %s: %s + %s",
        folder,
        detected.format,
        [p.name for p in detected.interaction_files],
        [p.name for p in detected.metadata_files],
    )
    if detected.format == "recbole":
        raw = read_recbole(detected.interaction_files, detected.metadata_files, config, folder)
    else:
        raw = read_amazon(
            detected.format, detected.interaction_files, detected.metadata_files, config, folder
        )
    check_reject_share(raw, config.max_reject_share)
    return raw


def read_interactions(files: list[Path]) -> pd.DataFrame:
    """The interactions of `files` (raw files of one format, in any folders) read together by
    `read_raw`, whatever share of their lines it rejects."""
    with tempfile.TemporaryDirectory() as tmp:  # the reader takes a folder: link the files into one
        for path in files:
            os.symlink(Path(path).resolve(), Path(tmp) / Path(path).name)
        return read_raw(tmp, ReadConfig(max_reject_share=1.0)).interactions


def read_dataset(
    dataset: str, raw_root: Path | str = "data/01_raw", config: ReadConfig | None = None
) -> RawDataset:
    """Read the dataset named ``dataset`` under ``raw_root`` (``ml-100k`` works out of the box)."""
    return read_raw(resolve_raw_folder(dataset, raw_root), config)
