"""Batch re-ranking: request files answered chunk by chunk, on every process of a launch, resumable.

* **Streamed.** `RequestFiles` reads a folder's request files in name order, one record at a time:
  a JSON list element by element, JSON Lines line by line, Parquet row group by row group. Memory
  holds one chunk (`chunk_size` requests) of requests and answers, whatever the size of the batch.
* **On every process.** Every process reads and validates each chunk (cheap) and decodes its share
  of it (`core/decode/shards.py`: decode batch ``b`` belongs to process ``b % size``); the answers
  are gathered, so rank 0 holds the whole chunk, in request order, and writes it.
* **Resumable.** A chunk is published whole (`datasets.AnswerChunksDataset`: a temp file renamed),
  under a key of the model, its serving settings, the input files' bytes and the chunk size
  (`job_key`). Run again with the same key, the chunks already published are skipped; any other key
  starts afresh.
* **Malformed requests** are answered with their reason (``ok`` false, ``error``), the others served.
  A file that is not JSON from some byte on keeps the answers before that byte and one row naming it.

The request log (`request_log.py`) gets each chunk's served answers after the chunk is published:
a batch killed between the two leaves that chunk's rows out of the log, never in it twice.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from diffusion_gr2.core.decode.shards import Shards, launch_shards, shared_decoding
from diffusion_gr2.core.serving.request_log import RequestLog, ServedModel, log_rows
from diffusion_gr2.core.serving.serving import RequestError, parse_request

__all__ = ["ANSWER_COLUMNS", "FORMATS", "answer_schema", "BatchJob", "RequestFiles", "job_key", "summarize"]

FORMATS = (".json", ".jsonl", ".parquet")  # a request file's suffix says how it is read
ANSWER_COLUMNS = [
    "file",
    "position",  # the request's place in its file (0-based; a JSON Lines file's line - 1)
    "request_id",
    "ok",
    "error",
    "ranking",
    "explanation",
    "valid",
    "unforced",
    "tau",
    "latency_ms",  # the decode call that answered the request's chunk, shared by its requests
]


def answer_schema() -> Any:
    """The Arrow types of `ANSWER_COLUMNS`: every chunk's file has them, whatever its values (a chunk
    of refusals only has no ranking to infer a type from)."""
    import pyarrow as pa

    types = {"position": pa.int64(), "ok": pa.bool_(), "valid": pa.bool_(), "unforced": pa.bool_()}
    types |= {"ranking": pa.list_(pa.string()), "tau": pa.float64(), "latency_ms": pa.float64()}
    return pa.schema([(c, types.get(c, pa.string())) for c in ANSWER_COLUMNS])


_READ_BYTES = 1 << 20  # a JSON list is read a MiB at a time
_PARQUET_ROWS = 1024


@dataclass(frozen=True)
class Record:
    """One request as read: its file, its place there, and the object (None where unreadable)."""

    file: str
    position: int
    value: Any
    error: str | None = None  # why nothing could be read here (the value is None)


def _json_list(path: Path) -> Iterator[tuple[Any, str | None]]:
    """The elements of a JSON list, parsed one at a time from a window of the file (a MiB at a time).

    A single object (one request, or ``{"requests": [...]}``) is read whole. A syntax error ends the
    file with one `(None, reason)`: what follows it cannot be told apart from the error.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as handle:
        text, pos, eof = handle.read(_READ_BYTES), 0, False
        pos = len(text) - len(text.lstrip())
        if not text[pos:].startswith("["):
            try:
                content = json.loads(text + handle.read())
            except json.JSONDecodeError as err:
                yield None, f"not JSON: {err}"
                return
            items = content.get("requests", [content]) if isinstance(content, Mapping) else None
            if not isinstance(items, list):
                yield None, f"a request file holds an object or a list, got {type(content).__name__}"
                return
            yield from ((item, None) for item in items)
            return
        pos += 1
        offset = 0  # bytes of the file before `text`
        while True:
            while True:  # skip separators, reading on where the window ends
                stripped = text[pos:].lstrip().lstrip(",").lstrip()
                pos = len(text) - len(stripped)
                if stripped or eof:
                    break
                more = handle.read(_READ_BYTES)
                eof = not more
                offset, text, pos = offset + pos, text[pos:] + more, 0
            if text[pos:].startswith("]"):
                return
            try:
                value, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as err:
                more = "" if eof else handle.read(_READ_BYTES)
                if not more:  # the whole rest is in the window: a real error
                    yield None, f"not JSON from character {offset + err.pos}: {err.msg}"
                    return
                offset, text, pos = offset + pos, text[pos:] + more, 0
                continue
            yield value, None
            pos = end


def _json_lines(path: Path) -> Iterator[tuple[Any, str | None]]:
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line), None
            except json.JSONDecodeError as err:
                yield None, f"line {number}: not JSON: {err.msg}"


def _parquet(path: Path) -> Iterator[tuple[Any, str | None]]:
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=_PARQUET_ROWS):
        yield from ((row, None) for row in batch.to_pylist())


_READERS = {".json": _json_list, ".jsonl": _json_lines, ".parquet": _parquet}


class RequestFiles:
    """The request files of a folder (`FORMATS`), in name order, read as a stream of `Record`."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        found = sorted(p for p in self.folder.rglob("*") if p.suffix in FORMATS and p.is_file())
        self.paths = [p for p in found if not p.name.startswith(".")]

    def name(self, path: Path) -> str:
        return path.relative_to(self.folder).as_posix()

    def records(self) -> Iterator[Record]:
        for path in self.paths:
            try:
                for position, (value, error) in enumerate(_READERS[path.suffix](path)):
                    yield Record(self.name(path), position, value, error)
            except (OSError, UnicodeDecodeError, ValueError) as err:  # unreadable from the start
                yield Record(self.name(path), -1, None, f"cannot read {self.name(path)}: {err}")

    def chunks(self, size: int) -> Iterator[list[Record]]:
        chunk: list[Record] = []
        for record in self.records():
            chunk.append(record)
            if len(chunk) == size:
                yield chunk
                chunk = []
        if chunk:
            yield chunk

    def digest(self) -> str:
        """SHA-256 over every file's name and bytes: another input, another key."""
        digest = hashlib.sha256()
        for path in self.paths:
            digest.update(f"{self.name(path)}|{path.stat().st_size}|".encode())
            with open(path, "rb") as handle:
                while block := handle.read(_READ_BYTES):
                    digest.update(block)
        return digest.hexdigest()


def job_key(model_digest: str, settings: Mapping[str, Any], files: RequestFiles, chunk_size: int) -> str:
    """12 hex digits naming a batch: the model's weights, its serving settings, the input, the chunking."""
    text = json.dumps({"model": model_digest, "settings": settings, "chunk_size": chunk_size}, sort_keys=True)
    return hashlib.sha256(f"{text}|{files.digest()}".encode()).hexdigest()[:12]


def _refusal(record: Record, reason: str) -> dict[str, Any]:
    rid = record.value.get("request_id") if isinstance(record.value, Mapping) else None
    return {
        "file": record.file,
        "position": record.position,
        "request_id": None if rid is None else str(rid),
        "ok": False,
        "error": reason,
    }


@dataclass
class BatchJob:
    """A batch of request files for a ranker (`serving.Ranker` or `PrerankRanker`), answered chunk by
    chunk as the output dataset saves it (`answer`), by every process of a launch."""

    files: RequestFiles
    ranker: Any
    served: ServedModel
    chunk_size: int
    key: str
    log: RequestLog | None = None

    def answer(self, done: set[int] | None = None) -> Iterator[tuple[int, pd.DataFrame]]:
        """(chunk index, answers) of every chunk not in `done`, on rank 0 (the other processes
        decode their share and get nothing back: `drain`). `done` is rank 0's."""
        shards = launch_shards()
        if shards is not None:
            done = shards.broadcast(done)
        done = done or set()
        leads = shards is None or shards.leads
        with shared_decoding(shards), tqdm(desc="rerank", unit="req", disable=not leads) as bar:
            for index, chunk in enumerate(self.files.chunks(self.chunk_size)):
                if index not in done:
                    frame, served = self._answer_chunk(chunk, shards)
                    if leads:
                        yield index, frame
                        if self.log is not None and served:  # after the chunk is published
                            self.log.append(log_rows(*zip(*served, strict=True), self.served, "rerank"))
                bar.update(len(chunk))

    def drain(self) -> None:
        """A process other than rank 0 decodes its share of every chunk (`runner.RankAwareRunner`)."""
        for _ in self.answer():
            pass

    def _answer_chunk(
        self, chunk: Sequence[Record], shards: Shards | None
    ) -> tuple[pd.DataFrame, list[tuple[Mapping[str, Any], dict[str, Any]]]]:
        rows: list[dict[str, Any] | None] = [None] * len(chunk)
        good = []
        for n, record in enumerate(chunk):
            if record.error is not None:
                rows[n] = _refusal(record, f"{record.file}: {record.error}")
            elif not isinstance(record.value, Mapping):
                rows[n] = _refusal(record, f"request {record.position}: not an object")
            else:
                try:
                    good.append(
                        (
                            n,
                            parse_request(
                                record.position, record.value, self.ranker.known, self.ranker.limits
                            ),
                        )
                    )
                except RequestError as err:
                    rows[n] = _refusal(record, err.message)
        start = time.perf_counter()
        answers = self.ranker.rank([request for _, request in good]) if good else []
        latency_ms = round(1000.0 * (time.perf_counter() - start), 2)
        for (n, _), answer in zip(good, answers, strict=True):
            record = chunk[n]
            rows[n] = {"file": record.file, "position": record.position, "ok": True, "error": None}
            rows[n] |= {k: answer[k] for k in ANSWER_COLUMNS[2:] if k in answer} | {"latency_ms": latency_ms}
        frame = pd.DataFrame(rows).reindex(columns=ANSWER_COLUMNS)
        served = [(chunk[n].value, answer) for (n, _), answer in zip(good, answers, strict=True)]
        return frame, served


def summarize(chunks: Mapping[str, Any], model_uri: str, max_refusals: int = 50) -> dict[str, Any]:
    """The batch's report from its published chunks (loaded one at a time): counts, the served
    answers' valid rate, and the first `max_refusals` refusals with their reasons."""
    requests = served = valid = 0
    refusals: list[dict[str, Any]] = []
    files: set[str] = set()
    for name in sorted(chunks):
        frame = chunks[name]()
        ok = frame["ok"].astype(bool)
        requests += len(frame)
        served += int(ok.sum())
        valid += int(frame.loc[ok, "valid"].astype(bool).sum())
        files.update(frame["file"])
        if len(refusals) < max_refusals:
            refused = frame.loc[~ok, ["file", "position", "request_id", "error"]]
            refusals += refused.head(max_refusals - len(refusals)).to_dict("records")
    return {
        "model_uri": model_uri,
        "files": len(files),
        "requests": requests,
        "served": served,
        "refused": requests - served,
        "valid_rate": valid / served if served else None,
        "refusals": refusals,
    }
