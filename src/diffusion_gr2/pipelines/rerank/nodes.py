"""rerank nodes: the served model over request files, in batch (docs/operations.md#serving)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import mlflow
import pandas as pd

from diffusion_gr2.core.registry.registry import resolve_uri
from diffusion_gr2.core.serving.request_log import (
    RequestLog,
    RequestLogConfig,
    ServedModel,
    log_rows,
    open_log,
)
from diffusion_gr2.core.serving.serving import Ranker, RequestError, parse_request

RESULT_COLUMNS = [
    "file",
    "request_id",
    "ok",
    "error",
    "ranking",
    "explanation",
    "valid",
    "unforced",
    "tau",
    "latency_ms",
]


def _records(content: Any) -> list[dict[str, Any]]:
    """A request file holds one request object, a list of them, or ``{"requests": [...]}``."""
    if isinstance(content, Mapping):
        content = content.get("requests", [content])
    if not isinstance(content, list):
        raise RequestError(f"a request file holds an object or a list, got {type(content).__name__}")
    return [r if isinstance(r, Mapping) else {"history": None, "candidates": None} for r in content]


def _file_rows(
    name: str, content: Any, ranker: Ranker, log: RequestLog | None, served: ServedModel
) -> list[dict[str, Any]]:
    """One row per request of one file; a malformed request gets its reason, the others are served
    (and appended to the request log, as the scoring server's answers are)."""
    try:
        records = _records(content)
    except RequestError as err:
        return [{"file": name, "request_id": None, "ok": False, "error": err.message}]
    rows: list[dict[str, Any] | None] = [None] * len(records)
    good = []
    for i, record in enumerate(records):
        try:
            good.append((i, parse_request(i, record, ranker.known, ranker.limits)))
        except RequestError as err:
            rows[i] = {
                "file": name,
                "request_id": str(record.get("request_id", i)),
                "ok": False,
                "error": err.message,
            }
    step = ranker.limits.max_requests
    for lo in range(0, len(good), step):
        chunk = good[lo : lo + step]
        answers = ranker.rank([req for _, req in chunk])
        if log is not None:
            log.append(log_rows([records[i] for i, _ in chunk], answers, served, "rerank"))
        for (i, _), answer in zip(chunk, answers, strict=True):
            rows[i] = {
                "file": name,
                "ok": True,
                "error": None,
                **{k: answer[k] for k in RESULT_COLUMNS[1:] if k in answer},
            }
    return [r for r in rows if r is not None]


def rerank_files(
    request_files: dict[str, Callable[[], Any]], params: dict[str, Any], serving: dict[str, Any]
) -> dict[str, Any]:
    """Re-rank every request of every file with the model at `params["model_uri"]` (the champion),
    appending each answer to the request log (`serving.request_log`)."""
    uri = params["model_uri"]
    ranker: Ranker = mlflow.pyfunc.load_model(uri).unwrap_python_model().ranker
    ref = resolve_uri(uri)
    answered_by = ServedModel(ref.name if ref else None, ref.version if ref else None, uri)
    log = open_log(RequestLogConfig(**serving["request_log"]))
    rows = [
        row
        for name in sorted(request_files)
        for row in _file_rows(name, request_files[name](), ranker, log, answered_by)
    ]
    frame = pd.DataFrame(rows).reindex(columns=RESULT_COLUMNS)
    served = frame[frame["ok"]]
    report = {
        "model_uri": params["model_uri"],
        "files": len(request_files),
        "requests": len(frame),
        "served": len(served),
        "refused": int((~frame["ok"]).sum()),
        "valid_rate": float(served["valid"].mean()) if len(served) else None,
        "refusals": frame.loc[~frame["ok"], ["file", "request_id", "error"]].to_dict("records")[:50],
    }
    return {"reranked": frame, "rerank_report": report}
