"""Taking in fresh interaction files for a retrain (docs/operations.md#retraining), and the lock that
serialises retrains.

Files dropped into the incoming folder are judged one at a time and as a whole: a file is read with
the project's own readers (`core/data/readers.py`) at a reject share of zero by default, and any
problem (unknown or foreign format, damaged compression, one bad line, no rows) moves it to the
quarantine folder beside a ``<name>.reason.txt``, with nothing of it merged. A good file adds only
the lines the raw folder does not hold yet, as a new file named after the incoming one and its hash,
so feeding the same file twice changes nothing. Taken-in files move to ``incoming/done/``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from diffusion_gr2.core.data.raw import RAW_INTERACTION_COLUMNS, ReadConfig, Rejects, iter_lines
from diffusion_gr2.core.data.readers import (
    classify_file,
    detect_format,
    has_data_files,
    read_interactions,
    read_raw,
)
from diffusion_gr2.core.data.recbole import EMBEDDED_DATASET, embedded_ml100k_folder
from diffusion_gr2.core.io import atomic_write_text
from diffusion_gr2.core.lineage.lineage import file_md5

logger = logging.getLogger(__name__)

__all__ = [
    "IngestConfig",
    "RetrainLockedError",
    "acquire_lock",
    "delivered_interactions",
    "ingest",
    "pending_delivery",
    "release_lock",
]


@dataclass(frozen=True)
class IngestConfig:
    """Where fresh files arrive and where they go."""

    incoming_dir: str = "data/01_raw/incoming"  # drop new interaction files here
    quarantine_dir: str = "data/01_raw/quarantine"  # refused files, each with <name>.reason.txt
    raw_root: str = "data/01_raw"
    dataset: str = "ml-100k"  # the raw folder merged into: <raw_root>/<dataset>
    max_reject_share: float = 0.0  # an incoming file with any rejected line is refused whole


def _data_lines(path: Path, has_header: bool) -> tuple[str | None, list[str]]:
    """(header, data lines) of a plain or gzip raw file, blank lines left out."""
    lines = [text for _, text in iter_lines(path, Rejects(), has_header=has_header)]
    if has_header:
        return (lines[0] if lines else None), lines[1:]
    return None, lines


def _raw_folder(config: IngestConfig) -> Path:
    """The raw folder; MovieLens-100k is first copied out of the recbole wheel so merges have a home."""
    folder = Path(config.raw_root) / config.dataset
    if not has_data_files(folder) and config.dataset == EMBEDDED_DATASET:
        folder.mkdir(parents=True, exist_ok=True)
        for path in embedded_ml100k_folder().iterdir():
            if classify_file(path.name):
                shutil.copy2(path, folder / path.name)
        logger.info("raw folder %s seeded with the MovieLens-100k of the recbole wheel", folder)
    return folder


def _validate(path: Path, raw_format: str, config: IngestConfig) -> tuple[int, str | None]:
    """(rows, None) for a good file, (0, reason) for one to quarantine."""
    kind = classify_file(path.name)
    if kind is None:
        return 0, f"unrecognised file name {path.name!r} (no reader for it)"
    fmt, role = kind
    if role != "inter":
        return 0, f"{path.name} is a {fmt} metadata file; retraining takes in interaction files only"
    if fmt != raw_format:
        return 0, f"{path.name} is {fmt} but the raw folder holds {raw_format}"
    with tempfile.TemporaryDirectory() as tmp:  # read the file alone, as the pipeline would
        os.symlink(path.resolve(), Path(tmp) / path.name)
        try:
            raw = read_raw(tmp, ReadConfig(max_reject_share=config.max_reject_share))
        except (ValueError, OSError) as err:  # DataQualityError, CorruptFileError, RawFolderError
            return 0, f"{type(err).__name__}: {err}".replace(tmp, str(path.parent))
    if raw.rows_read == 0 or raw.interactions.empty:
        return 0, f"{path.name} holds no interaction rows"
    return len(raw.interactions), None


def _quarantine(path: Path, reason: str, config: IngestConfig) -> None:
    folder = Path(config.quarantine_dir)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.move(str(path), folder / path.name)
    atomic_write_text(folder / f"{path.name}.reason.txt", reason + "\n")
    logger.warning("quarantined %s: %s", path.name, reason)


def _merged_name(path: Path, digest: str) -> str:
    """``fresh.inter`` -> ``fresh-<md5 8>.inter`` (plain text: ``.gz`` is dropped), same reader."""
    name = path.name.removesuffix(".gz")
    stem, dot, ext = name.partition(".")
    return f"{stem}-{digest[:8]}{dot}{ext}"


def ingest(config: IngestConfig, dry_run: bool = False) -> dict[str, Any]:
    """Validate and merge every file in the incoming folder; the report lists each file's fate.

    `dry_run` judges every file the same way but moves, writes and quarantines nothing (what a
    retrain would take in; `python -m diffusion_gr2 retrain` skips training when it is nothing).
    """
    return _take_in(config, dry_run)[0]


def delivered_interactions(report: dict[str, Any] | None) -> pd.DataFrame:
    """The rows an ingest merged (its report's ``merged_as`` files in its raw folder), parsed; empty
    when it merged none. The shadow evaluation reads users' next interactions from them."""
    files = [
        Path(report["raw_folder"], f["merged_as"])
        for f in (report or {}).get("files", [])
        if "merged_as" in f
    ]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"the ingest report names merged files that are gone: {missing[:5]}")
    return read_interactions(files) if files else pd.DataFrame(columns=RAW_INTERACTION_COLUMNS)


def pending_delivery(config: IngestConfig) -> tuple[dict[str, Any], pd.DataFrame]:
    """(the dry run's ingest report, the rows a retrain would merge now, parsed): nothing moves.

    The rows are read as the merged files will be (the same names, the same reader).
    """
    report, merged = _take_in(config, dry_run=True)
    if not merged:
        return report, pd.DataFrame(columns=RAW_INTERACTION_COLUMNS)
    with tempfile.TemporaryDirectory() as tmp:
        for name, body in merged.items():
            Path(tmp, name).write_text(body)
        return report, read_interactions(sorted(Path(tmp).iterdir()))


def _take_in(config: IngestConfig, dry_run: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """The ingest report and the merged files' text by name (written unless `dry_run`)."""
    incoming = Path(config.incoming_dir)
    folder = _raw_folder(config)
    detected = detect_format(folder)
    has_header = detected.format == "recbole"
    known: set[str] = set()
    for path in detected.interaction_files:
        known.update(_data_lines(path, has_header)[1])
    files = (
        sorted(p for p in incoming.iterdir() if p.is_file() and not p.name.startswith("."))
        if incoming.is_dir()
        else []
    )
    report: dict[str, Any] = {"raw_folder": str(folder), "format": detected.format, "files": []}
    merged: dict[str, str] = {}
    for path in files:
        digest = file_md5(path)
        rows, reason = _validate(path, detected.format, config)
        if reason is not None:
            if not dry_run:
                _quarantine(path, reason, config)
            report["files"].append(
                {"file": path.name, "md5": digest, "status": "quarantined", "reason": reason}
            )
            continue
        header, lines = _data_lines(path, has_header)
        new = list(dict.fromkeys(line for line in lines if line not in known))
        if new:
            body = "\n".join(([header] if header is not None else []) + new) + "\n"
            merged[_merged_name(path, digest)] = body
            if not dry_run:
                atomic_write_text(folder / _merged_name(path, digest), body)
        known.update(new)
        if not dry_run:
            done = incoming / "done"
            done.mkdir(exist_ok=True)
            shutil.move(str(path), done / path.name)
        status = "merged" if new else "duplicate"
        entry = {"file": path.name, "md5": digest, "status": status, "rows": rows, "new_rows": len(new)}
        report["files"].append(entry | ({"merged_as": _merged_name(path, digest)} if new else {}))
        logger.info("%s: %d rows, %d new, %s", path.name, rows, len(new), status)
    report["new_rows"] = sum(f.get("new_rows", 0) for f in report["files"])
    report["quarantined"] = sum(f["status"] == "quarantined" for f in report["files"])
    report["raw_md5"] = hashlib.md5(
        "".join(file_md5(p) for p in sorted(folder.iterdir()) if p.is_file()).encode()
    ).hexdigest()
    return report, merged


class RetrainLockedError(RuntimeError):
    """Another retrain holds the lock."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def acquire_lock(path: str | Path) -> None:
    """Create the lock file (holding this pid) or refuse: one retrain at a time.

    A lock whose process is gone (a killed retrain) is stale and taken over, with a warning.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            text = path.read_text().strip() if path.exists() else ""
            pid = int(text) if text.isdigit() else -1
            if pid == os.getpid():
                return
            if pid > 0 and _alive(pid):
                raise RetrainLockedError(
                    f"a retrain (pid {pid}) holds {path}; wait for it or remove a stale lock"
                ) from None
            logger.warning("removing stale retrain lock %s (pid %s is gone)", path, text or "?")
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as handle:
            handle.write(str(os.getpid()))
        return
    raise RetrainLockedError(f"could not take the retrain lock {path}")


def release_lock(path: str | Path) -> None:
    """Remove the lock file if this process holds it."""
    path = Path(path)
    if path.exists() and path.read_text().strip() == str(os.getpid()):
        path.unlink()
