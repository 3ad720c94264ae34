"""The request log: every request the served model answers, one JSON line each
(docs/operations.md#request-log).

A row holds the request (id, user, history, candidates in raw ids), the answer (ranking, explanation,
served and own validity, tokens, forwards, latency), the model that answered (registered name,
version, system, operating point), where it was served (`source`: the scoring server or the batch
re-rank) and when. The shadow evaluation of the gate (`core/registry/shadow.py`) replays these rows
through the challenger and, once a delivery says what each user did next, scores both.

Writes are atomic with respect to crashes and to concurrent workers:

* one row is one ``os.write`` of the whole line on an ``O_APPEND`` descriptor, under an exclusive
  ``fcntl`` lock on a lock file beside the log, so rows of several server workers or of the batch
  pipeline never interleave, and rotation never races an append;
* a process killed inside that write can leave at most a torn last line (no trailing newline); the
  next writer cuts it off under the lock before appending, and `read_log` skips (and counts) one
  it finds first, so no reader ever sees a half row.

The log is bounded: when the current file would pass `max_bytes` it is renamed ``requests.1.jsonl``
(older ones shift up) and a fresh file starts; past `backups` files the oldest is deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd

logger = logging.getLogger(__name__)

__all__ = [
    "ENV_CONFIG",
    "ENV_MODEL",
    "LOG_NAME",
    "RequestLog",
    "RequestLogConfig",
    "ServedModel",
    "encode",
    "log_rows",
    "open_log",
    "read_log",
    "server_environment",
]

LOG_NAME = "requests.jsonl"  # the current file; rotated ones are requests.<k>.jsonl, k = 1 newest
LOCK_NAME = ".requests.lock"  # a stable inode to lock: the log itself is renamed by rotation
# How `python -m diffusion_gr2 serve` hands the settings and the served version to the scoring
# server's workers (they load the pyfunc model without the project's configuration).
ENV_CONFIG = "DIFFUSION_GR2_REQUEST_LOG"  # RequestLogConfig as JSON; unset: no log
ENV_MODEL = "DIFFUSION_GR2_SERVED_MODEL"  # ServedModel as JSON

REQUEST_KEYS = ("request_id", "user_id", "history", "candidates")
ANSWER_KEYS = (
    "ranking",
    "explanation",
    "valid",
    "unforced",
    "reason",
    "system",
    "tau",
    "window",
    "output_tokens",
    "nfe",
    "unknown_history",
    "latency_ms",
)


@dataclass(frozen=True)
class RequestLogConfig:
    """Where the log lives and how large it may grow (`conf/base/parameters_serving.yml`)."""

    enabled: bool
    folder: str
    max_bytes: int  # one file's size before it is rotated
    backups: int  # rotated files kept; the log holds at most (backups + 1) * max_bytes

    def __post_init__(self) -> None:
        if self.max_bytes < 1024 or self.backups < 0:
            raise ValueError(f"request_log: max_bytes >= 1024 and backups >= 0, got {self}")

    @classmethod
    def from_env(cls) -> RequestLogConfig | None:
        """The settings the launcher put in the environment; None when it put none (no log)."""
        text = os.environ.get(ENV_CONFIG)
        if not text:
            return None
        try:
            return cls(**json.loads(text))
        except (TypeError, ValueError) as err:
            raise ValueError(f"{ENV_CONFIG} is not a request_log setting: {err}: {text[:200]}") from err


@dataclass(frozen=True)
class ServedModel:
    """Which registered version answered: name and version (None when served from a bare folder)."""

    name: str | None = None
    version: str | None = None
    uri: str | None = None

    @classmethod
    def from_env(cls) -> ServedModel:
        text = os.environ.get(ENV_MODEL)
        return cls(**json.loads(text)) if text else cls()


class RequestLog:
    """Appends rows to ``<folder>/requests.jsonl`` (module docstring: atomicity and rotation)."""

    def __init__(self, config: RequestLogConfig):
        self.config = config
        self.folder = Path(config.folder)
        self.path = self.folder / LOG_NAME

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock, also when the write raised

    def _rotate(self) -> None:
        """requests.jsonl -> requests.1.jsonl, k -> k + 1, the one past `backups` deleted (under the lock)."""
        backups = self.config.backups
        if backups == 0:
            self.path.unlink(missing_ok=True)
            return
        (self.folder / f"requests.{backups}.jsonl").unlink(missing_ok=True)
        for k in range(backups - 1, 0, -1):
            older = self.folder / f"requests.{k}.jsonl"
            if older.exists():
                os.replace(older, self.folder / f"requests.{k + 1}.jsonl")
        os.replace(self.path, self.folder / "requests.1.jsonl")

    def append(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Append `rows`, each one line written whole; rotates first when the file would pass `max_bytes`."""
        lines = [encode(row) for row in rows]
        with self._locked():
            for line in lines:
                self._append_line(line)

    def _append_line(self, line: bytes) -> None:
        size = self.path.stat().st_size if self.path.exists() else 0
        if size and size + len(line) > self.config.max_bytes:
            self._rotate()
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)  # read: the tail check
        try:
            _cut_torn_tail(fd)
            written = os.write(fd, line)  # one call: the row is in the file whole or not at all
            if written != len(line):  # a short write (disk full): take it back, never leave half a row
                os.ftruncate(fd, os.fstat(fd).st_size - written)
                raise OSError(f"request log {self.path}: wrote {written} of {len(line)} bytes")
        finally:
            os.close(fd)


def _cut_torn_tail(fd: int) -> None:
    """Cut a last line without its newline (a writer killed mid-write) so the next row starts clean."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    cut, end = 0, size
    while end > 0:  # back to the last newline, a block at a time
        start = max(0, end - 65536)
        block = os.pread(fd, end - start, start)
        if b"\n" in block:
            cut = start + block.rfind(b"\n") + 1
            break
        end = start
    logger.warning("request log: cut a torn last row (%d bytes) left by a crashed writer", size - cut)
    os.ftruncate(fd, cut)


def encode(row: Mapping[str, Any]) -> bytes:
    """One row as the log holds it: compact JSON and its newline."""
    return json.dumps(row, default=_plain, separators=(",", ":")).encode() + b"\n"


def _plain(obj: Any) -> Any:
    """numpy scalars and arrays (pandas rows hold them) as JSON values."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def log_rows(
    records: Sequence[Mapping[str, Any]],
    answers: Sequence[Mapping[str, Any]],
    model: ServedModel,
    source: str,
) -> list[dict[str, Any]]:
    """The log rows of one call: each request (as sent, raw ids) with its answer and who answered."""
    now = time.time()
    stamp = datetime.fromtimestamp(now, UTC).isoformat(timespec="milliseconds")
    rows = []
    for record, answer in zip(records, answers, strict=True):
        request = {k: _value(record.get(k)) for k in REQUEST_KEYS}
        request["request_id"] = answer.get("request_id", request["request_id"])
        rows.append(
            {"time": stamp, "ts": now, "source": source}
            | {"model_name": model.name, "model_version": model.version}
            | request
            | {k: answer.get(k) for k in ANSWER_KEYS}
        )
    return rows


def _value(value: Any) -> Any:
    """A request field as JSON: arrays as lists, a missing value (None, NaN) as None, ids as strings."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [str(v) for v in value] if isinstance(value, list) else str(value)


def _files(folder: Path) -> list[Path]:
    """The log's files, oldest first."""
    rotated = [p for p in folder.glob("requests.*.jsonl") if p.name.split(".")[1].isdigit()]
    rotated.sort(key=lambda p: -int(p.name.split(".")[1]))
    current = folder / LOG_NAME
    return rotated + ([current] if current.exists() else [])


def read_log(folder: str | Path) -> tuple[pd.DataFrame, int]:
    """(every whole row of the log, oldest first; the number of torn or unreadable lines skipped)."""
    rows, skipped = [], 0
    for path in _files(Path(folder)):
        data = path.read_bytes()
        for number, line in enumerate(data.split(b"\n"), start=1):
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except ValueError:
                skipped += 1
                logger.warning("request log %s line %d: not a whole row, skipped", path, number)
    return pd.DataFrame(rows), skipped


def open_log(config: RequestLogConfig | None) -> RequestLog | None:
    """The log to append to, or None when there are no settings or they turn it off."""
    return RequestLog(config) if config is not None and config.enabled else None


def server_environment(config: RequestLogConfig, model: ServedModel) -> dict[str, str]:
    """The variables that carry the settings and the served version to the scoring server's workers."""
    folder = str(Path(config.folder).resolve())  # the server may run in another working directory
    return {ENV_CONFIG: json.dumps(asdict(config) | {"folder": folder}), ENV_MODEL: json.dumps(asdict(model))}
