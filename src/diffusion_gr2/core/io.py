"""Atomic artifact writes: a file or directory appears complete or not at all.

Every artifact and checkpoint goes through these helpers so that a crash mid-write never leaves a
half-written file for a downstream stage (or a resumed run) to read (docs/architecture.md#training-stages,
"Atomic writes"). The pattern is always: write into a temp path in the *same* folder (same filesystem, so the
rename is atomic), flush to disk, then ``os.replace`` onto the final name.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pandas as pd

logger = logging.getLogger(__name__)

__all__ = [
    "atomic_directory",
    "atomic_write_json",
    "atomic_write_parquet",
    "atomic_write_text",
    "publish_directory",
]


def _json_default(obj: Any) -> Any:
    """Serialise numpy scalars/arrays and paths, which ``json`` refuses by default."""
    if hasattr(obj, "tolist"):  # numpy scalar or array
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serialisable")


def _fsync_dir(folder: Path) -> None:
    """Persist a rename by syncing the parent directory (best effort: not every OS allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write(path: str | Path, write: Callable[[IO[bytes]], None]) -> Path:
    """Call ``write(handle)`` on a temp file beside ``path``, then replace ``path`` with it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; returns the final path."""
    return _atomic_write(path, lambda handle: handle.write(text.encode("utf-8")))


def _json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, ±inf) replaced by None, containers walked.

    JSON has no NaN: ``json.dumps`` would write the bare token ``NaN``, which strict readers (``jq``,
    browsers, other languages) refuse. ``null`` is what pandas' ``to_json`` writes for a missing number.
    """
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is pd.NA or obj is pd.NaT:
        return None
    if isinstance(obj, dict):
        return {key: _json_safe(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(value) for value in obj]
    if hasattr(obj, "tolist") and not isinstance(obj, str):  # numpy scalar or array
        return _json_safe(obj.tolist())
    return obj


def atomic_write_json(path: str | Path, obj: Any, indent: int = 2) -> Path:
    """Write ``obj`` as strict JSON to ``path`` atomically; returns the final path.

    numpy values are allowed; NaN and infinities are written as ``null`` (`_json_safe`). The object is
    serialised *before* the temp file is opened, so an unserialisable object raises without touching
    the disk.
    """
    text = json.dumps(
        _json_safe(obj), indent=indent, default=_json_default, ensure_ascii=False, allow_nan=False
    )
    return atomic_write_text(path, text + "\n")


def atomic_write_parquet(df: pd.DataFrame, path: str | Path, schema: Any = None) -> Path:
    """Write ``df`` to a parquet file at ``path`` atomically (pyarrow engine, with the pyarrow
    ``schema`` where given: parts of one dataset then share their types); returns the final path."""
    return _atomic_write(path, lambda handle: df.to_parquet(handle, engine="pyarrow", schema=schema))


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temp directory beside ``path``; on success it replaces ``path``.

    On an exception the temp directory is removed and an existing ``path`` is left untouched. When
    ``path`` already exists it is first renamed aside, the new directory renamed in, and only then is
    the old one deleted — so at every instant either the old or the new complete directory exists under
    a known name (a crash between the two renames leaves ``<name>.old-*`` beside it, never a partial one).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _swap_directory(tmp, path)


def publish_directory(tmp: str | Path, path: str | Path) -> Path:
    """Flush a finished temp directory to disk and rename it onto ``path`` (what `atomic_directory` ends
    with), for folders several processes write into before one of them publishes it."""
    tmp, path = Path(tmp), Path(path)
    _fsync_tree(tmp)
    _swap_directory(tmp, path)
    return path


def _fsync_tree(folder: Path) -> None:
    """Flush every file under ``folder``, then the folders themselves, to disk.

    Without it the rename can reach the disk before the data: after a power cut the directory would
    exist under its final name with empty or short files (ext4 ``data=writeback``, XFS).
    """
    for dirpath, _, filenames in os.walk(folder, topdown=False):
        for name in filenames:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _swap_directory(tmp: Path, path: Path) -> None:
    """Move the finished ``tmp`` onto ``path``, removing the previous ``path`` after the rename."""
    old: Path | None = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(path, old)
    try:
        os.replace(tmp, path)
    except BaseException:
        if old is not None:  # put the previous version back so nothing is lost
            os.replace(old, path)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    logger.debug("atomically wrote directory %s", path)
