"""Kedro datasets whose writes are atomic: a reader sees the old file or the new one, never half.

Kedro's stock datasets write in place; a crash mid-write would leave a truncated file that the next
``kedro run`` reads. These write to a temporary file beside the target and rename it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path, PurePosixPath
from typing import Any

import pandas as pd
from kedro.io import AbstractDataset, DatasetError

from diffusion_gr2.core.base.manifest import RUN_REPORTS, current_manifest, load_reports, stamp, unstamp
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
    """A JSON report (``data/08_reporting/*.json``) written atomically. A file stamped with its run's
    manifest (`RunReportDataset`) loads as its data: nodes never see the stamp."""

    def load(self) -> Any:
        if not self.path.exists():
            raise self._missing()
        return unstamp(json.loads(self.path.read_text()))[0]

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


class RunReportDataset(AtomicJSONDataset):
    """A report of the evaluation or benchmark stage, stored with the manifest of the run that wrote it
    (`core.base.manifest`: run id, commit, env, pipelines, start, the models' digests), so that
    `make results` and the report can say which run each figure came from."""

    def save(self, data: Any) -> None:
        atomic_write_json(self.path, stamp(data, current_manifest()))


class PretrainedDataset(_AtomicFileDataset):
    """A Hugging Face model or tokenizer directory, written by the one model writer (`save_model`: atomic).

    On save it is also logged to the active MLflow run under ``models/<folder name>``, so every
    stage's model sits beside the parameters and metrics that produced it.
    """

    def __init__(
        self,
        filepath: str,
        kind: str = "model",
        tokenizer_path: str | None = None,
        log_to_mlflow: bool = True,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(filepath, metadata)
        # A model directory also carries its tokenizer, so it loads (and serves) on its own.
        self._tokenizer_path = Path(tokenizer_path) if tokenizer_path else None
        if kind not in ("model", "tokenizer"):
            raise DatasetError(f"PretrainedDataset kind must be 'model' or 'tokenizer', got {kind!r}")
        self._kind = kind
        self._log_to_mlflow = log_to_mlflow

    def _describe(self) -> dict[str, Any]:
        return {"filepath": str(self._filepath), "kind": self._kind}

    def load(self) -> Any:
        if not self.path.exists():
            raise self._missing()
        if self._kind == "tokenizer":
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(self.path, local_files_only=True)
        from diffusion_gr2.core.model.factory import load_model

        return load_model(self.path)

    def save(self, data: Any) -> None:
        from diffusion_gr2.core.model.factory import save_model

        if self._kind == "tokenizer":
            save_model(None, data, self.path)
        else:
            save_model(data, self._tokenizer_path, self.path)
        if self._log_to_mlflow:
            from diffusion_gr2.core.runs.mlflow_utils import log_model_directory

            log_model_directory(self.path, self.path.name)


class OptionalJSONDataset(AtomicJSONDataset):
    """A JSON report another, optional stage writes (`benchmark.json` after `make benchmark`): loads
    None while the file does not exist, so a reader can say it is absent instead of failing."""

    def load(self) -> Any:
        return unstamp(json.loads(self.path.read_text()))[0] if self.path.exists() else None


class ReportRunsDataset(AbstractDataset[None, Any]):
    """Read-only: the manifests of the run reports in `folder` (`manifest.load_reports`), for the run
    report's list of the runs its figures come from."""

    def __init__(self, folder: str, metadata: dict[str, Any] | None = None) -> None:
        self._folder = PurePosixPath(folder)
        self.metadata = metadata

    def _describe(self) -> dict[str, Any]:
        return {"folder": str(self._folder)}

    def load(self) -> Any:
        return load_reports(Path(self._folder), RUN_REPORTS)

    def save(self, data: Any) -> None:
        raise DatasetError("ReportRunsDataset is read-only: the reports it reads carry their own manifests")


class _FolderDataset(AbstractDataset[Any, Any]):
    """A dataset whose data is a folder of files (its `path`)."""

    def __init__(self, path: str, metadata: dict[str, Any] | None = None) -> None:
        self._path = PurePosixPath(path)
        self.metadata = metadata

    @property
    def path(self) -> Path:
        return Path(self._path)

    def _describe(self) -> dict[str, Any]:
        return {"path": str(self._path)}


class RequestFilesDataset(_FolderDataset):
    """Read-only: the request files of a folder for batch re-ranking (`.json`, `.jsonl`, `.parquet`),
    loaded as a stream (`core/serving/batch.py::RequestFiles`), never whole."""

    def load(self) -> Any:
        from diffusion_gr2.core.serving.batch import FORMATS, RequestFiles

        files = RequestFiles(self.path)
        if not files.paths:
            raise DatasetError(
                f"no request file in {self._path}: put the requests there as {', '.join(FORMATS)} files"
            )
        return files

    def save(self, data: Any) -> None:
        raise DatasetError("RequestFilesDataset is read-only: request files are delivered, not written")


class AnswerChunksDataset(_FolderDataset):
    """Batch answers as one Parquet file per chunk in `path` (``part-000000.parquet``, ...), each
    written whole (a temp file renamed), beside ``_job.json`` (the job's key, and whether it is
    complete). `pandas.read_parquet(path)` reads them as one frame.

    Saving a `core/serving/batch.py::BatchJob` answers it chunk by chunk: with the key of the
    published chunks it resumes after them; another key deletes them first. Loading gives Kedro's
    partitioned form (chunk name -> a function that loads it), for a complete job only: a batch
    that was stopped is resumed, never read.
    """

    JOB = "_job.json"

    def _job(self) -> dict[str, Any] | None:
        meta = self.path / self.JOB
        return json.loads(meta.read_text()) if meta.exists() else None

    def _parts(self) -> dict[int, Path]:
        return {int(p.stem.removeprefix("part-")): p for p in self.path.glob("part-*.parquet")}

    def _exists(self) -> bool:
        job = self._job()
        return bool(job and job.get("complete"))

    def load(self) -> dict[str, Any]:
        job = self._job()
        if not job or not job.get("complete"):
            state = "holds no batch" if job is None else "holds a batch that did not finish"
            raise DatasetError(f"{self.path} {state}: run the rerank pipeline (again, to resume it)")
        return {p.stem: functools.partial(pd.read_parquet, p) for _, p in sorted(self._parts().items())}

    def save(self, data: Any) -> None:
        job, parts = self._job(), self._parts()
        if job is not None and job.get("key") == data.key:
            done = set(parts)
        else:  # another model, input or chunking: start afresh
            for part in parts.values():
                part.unlink()
            done = set()
        from diffusion_gr2.core.serving.batch import answer_schema

        atomic_write_json(self.path / self.JOB, {"key": data.key, "complete": False})
        for index, frame in data.answer(done):
            atomic_write_parquet(frame, self.path / f"part-{index:06d}.parquet", answer_schema())
        atomic_write_json(self.path / self.JOB, {"key": data.key, "complete": True})
