"""rerank nodes (batch re-ranking): the served model over request files, streamed and resumable
(docs/operations.md#batch-re-ranking; the algorithm: core/serving/batch.py)."""

from __future__ import annotations

from typing import Any

import mlflow
import torch

from diffusion_gr2.core.registry.registry import resolve_uri
from diffusion_gr2.core.serving.batch import BatchJob, RequestFiles, job_key, summarize
from diffusion_gr2.core.serving.request_log import RequestLogConfig, ServedModel, open_log
from diffusion_gr2.core.train.checkpoint import content_fingerprint


def answer_requests(files: RequestFiles, params: dict[str, Any], serving: dict[str, Any]) -> BatchJob:
    """Every request of every file answered by the model at `params["model_uri"]` (the champion), as
    the `reranked` dataset saves the job chunk by chunk; served answers go to the request log
    (`serving.request_log`), written by rank 0."""
    uri = params["model_uri"]
    ranker = mlflow.pyfunc.load_model(uri).unwrap_python_model().ranker
    ref = resolve_uri(uri)
    served = ServedModel(ref.name if ref else None, ref.version if ref else None, uri)
    model = getattr(ranker, "model", None)  # the pre-rank's has no weights
    digest = content_fingerprint({}, torch.nn.Module() if model is None else model)
    key = job_key(digest, {"serving": ranker.config.to_json()}, files, int(params["chunk_size"]))
    log = open_log(RequestLogConfig(**serving["request_log"]))
    return BatchJob(files, ranker, served, int(params["chunk_size"]), key, log)


def summarize_answers(reranked: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The batch's report (counts, valid rate, the first refusals), reading one chunk at a time."""
    return summarize(reranked, params["model_uri"])
