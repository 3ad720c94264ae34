"""The run a report file came from: its manifest, stamped into the file, and the one loader that reads
report files back and says which run each figure came from (docs/evaluation.md#which-run-a-figure-came-from).

A report the evaluation and benchmark stages write (`stage_metrics.json`, `comparisons.json`,
`operating_point.json`, `reasoning_metrics.json`, `benchmark.json`, `speedup_by_length.json`) is
stored as ``{"manifest": {...}, "data": <the report>}``. The manifest names the MLflow run id, the git
commit the run started from, the Kedro environment, the pipelines asked for (and whether only part of
them ran), the run's start time, the machine, the node that wrote the file and the content digests of
the model folders the run loaded before writing it (``model_<system>`` -> digest, `DigestCache`).

The stamp is put on once, by the dataset (`diffusion_gr2.datasets.RunReportDataset`) from the run
context a hook opens (`begin_run`, `note_models`, `end_run`; `hooks.RunManifestHooks`): nodes never
see it, and a file written outside a Kedro run says so (``run_id`` None, ``env`` "none").

`load_reports` reads a set of such files and groups them by source run; `RunSources.conflicts` lists
model digests that two source runs disagree on (a benchmark that timed other weights than the ones
the accuracy figures measured). Files written before manifests existed load as data with no manifest
and are labelled so. Nothing here imports Kedro, MLflow or torch (`make results` stays light).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT",
    "RUN_REPORTS",
    "MixedRunsError",
    "ReportFileError",
    "RunManifest",
    "RunSources",
    "begin_run",
    "current_manifest",
    "end_run",
    "load_reports",
    "note_models",
    "read_report",
    "stamp",
    "unstamp",
]

FORMAT = "diffusion_gr2.run_manifest/1"  # marks a stamped report; a new layout gets a new number
NO_RECORD = "no run record"  # the source of files written without a manifest
# The files the evaluation and benchmark stages stamp (conf/base/catalog_*.yml: `RunReportDataset`).
RUN_REPORTS = (
    "stage_metrics.json",
    "comparisons.json",
    "operating_point.json",
    "reasoning_metrics.json",
    "benchmark.json",
    "speedup_by_length.json",
)


class ReportFileError(FileNotFoundError):
    """A report file is missing or is not valid JSON."""


class MixedRunsError(ValueError):
    """Report files that must come from one run came from several (or measured different models)."""


@dataclass(frozen=True)
class RunManifest:
    """Where a report file came from. ``run_id`` None: written outside a tracked Kedro run."""

    run_id: str | None
    git_commit: str = "unknown"
    git_dirty: bool = False
    env: str = "none"
    pipelines: tuple[str, ...] = ()
    partial: bool = False  # part of the pipelines ran (`--nodes`, `--from-nodes`, `--tags`, ...)
    started: str = ""  # ISO time the run started (UTC)
    machine: Mapping[str, Any] = field(default_factory=dict)  # cpu_cores, torch_threads, gpu
    models: Mapping[str, str] = field(default_factory=dict)  # model dataset -> folder digest, as loaded
    node: str | None = None  # the node that wrote the file
    format: str = FORMAT

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["pipelines"], out["machine"], out["models"] = (
            list(self.pipelines),
            dict(self.machine),
            dict(self.models),
        )
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> RunManifest:
        known = {f for f in cls.__dataclass_fields__}
        values = {k: v for k, v in raw.items() if k in known}
        values["pipelines"] = tuple(values.get("pipelines") or ())
        values["git_dirty"] = str(values.get("git_dirty", False)).lower() == "true"
        return cls(**values)

    @property
    def source(self) -> tuple[Any, ...]:
        """What makes two files the same run's: the MLflow run id, else the start time and commit."""
        return ("run", self.run_id) if self.run_id else ("untracked", self.started, self.git_commit)

    def label(self) -> str:
        """`run 1a2b3c4d (2026-12-03T16:31:14+00:00, commit c3989ec, env local, pipelines inference,
        evaluation)`: enough to find the run in MLflow and the code in git."""
        run = f"run {self.run_id[:8]}" if self.run_id else "a run outside MLflow"
        commit = self.git_commit[:7] + (" (uncommitted changes)" if self.git_dirty else "")
        pipelines = ", ".join(self.pipelines) or "?"
        part = ", part of them" if self.partial else ""
        return f"{run} ({self.started or 'start unknown'}, commit {commit}, env {self.env}, pipelines {pipelines}{part})"


# ---- the run context: opened by a hook, read by the dataset that stamps -------------------------------

_ACTIVE: RunManifest | None = None


def begin_run(manifest: RunManifest) -> None:
    """Open the run whose manifest every report written from now on carries (a hook calls this once)."""
    global _ACTIVE
    _ACTIVE = replace(manifest, models=dict(manifest.models), node=None)


def note_models(models: Mapping[str, str | None], node: str | None = None) -> None:
    """A node is about to run: remember the model folders it loads (name -> digest) and its name."""
    global _ACTIVE
    if _ACTIVE is None:
        return
    seen = {**_ACTIVE.models, **{k: v for k, v in models.items() if v}}
    _ACTIVE = replace(_ACTIVE, models=seen, node=node)


def end_run() -> None:
    """Close the run: a file written after this (outside a run) is stamped as such."""
    global _ACTIVE
    _ACTIVE = None


def current_manifest() -> RunManifest:
    """The open run's manifest, or one saying the file was written outside a Kedro run."""
    if _ACTIVE is not None:
        return _ACTIVE
    return RunManifest(run_id=None, started=datetime.now(UTC).isoformat(timespec="seconds"))


# ---- stamped files --------------------------------------------------------------------------------------


def stamp(data: Any, manifest: RunManifest) -> dict[str, Any]:
    """The stored form of a report: its manifest, then its data."""
    return {"manifest": manifest.as_dict(), "data": data}


def unstamp(stored: Any) -> tuple[Any, RunManifest | None]:
    """(data, manifest) of a stored report; a file written before manifests: (itself, None)."""
    if (
        isinstance(stored, dict)
        and set(stored) == {"manifest", "data"}
        and isinstance(stored["manifest"], dict)
        and stored["manifest"].get("format") == FORMAT
    ):
        return stored["data"], RunManifest.from_dict(stored["manifest"])
    return stored, None


def read_report(path: Path | str) -> tuple[Any, RunManifest | None]:
    """(data, manifest) of one report file; `ReportFileError` when missing or not JSON."""
    path = Path(path)
    if not path.exists():
        raise ReportFileError(f"{path}: not found")
    try:
        return unstamp(json.loads(path.read_text()))
    except json.JSONDecodeError as err:
        raise ReportFileError(f"{path}: not valid JSON ({err})") from err


# ---- the one loader -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSources:
    """Report files read together: their data, their manifests, and the runs they came from."""

    data: Mapping[str, Any]  # file name -> data (None: absent)
    manifests: Mapping[str, RunManifest | None]  # file name -> manifest (None: no run record); present only
    folder: Path | None = None  # where they were read (`data/08_reporting`)

    def runs(self) -> list[tuple[RunManifest | None, list[str]]]:
        """Each source run (its manifest, None for files with no run record) with its files, in the
        order the files were asked for."""
        groups: dict[Any, tuple[RunManifest | None, list[str]]] = {}
        for name, manifest in self.manifests.items():
            key = NO_RECORD if manifest is None else manifest.source
            groups.setdefault(key, (manifest, []))[1].append(name)
        return list(groups.values())

    @property
    def mixed(self) -> bool:
        """More than one source run (files with no run record count as one of unknown origin)."""
        return len(self.runs()) > 1

    def conflicts(self) -> list[str]:
        """One line per model two files measured with different weights: ``model_rl: benchmark.json
        d41d8cd9 vs operating_point.json 0cc175b9``."""
        seen: dict[str, tuple[str, str]] = {}  # model -> (digest, first file)
        lines = []
        for name, manifest in self.manifests.items():
            for model, digest in (manifest.models if manifest else {}).items():
                if model not in seen:
                    seen[model] = (digest, name)
                elif seen[model][0] != digest:
                    first_digest, first = seen[model]
                    lines.append(f"{model}: {first} {first_digest[:8]} vs {name} {digest[:8]}")
        return lines

    def check(self, strict: bool) -> None:
        """With `strict`, refuse (`MixedRunsError`) files from more than one run, files with no run
        record, and files whose runs measured different weights of one model. Without it, nothing:
        the reader labels each run (`source_lines`) and flags the conflicts itself."""
        if not strict:
            return
        problems = []
        if self.mixed:
            problems.append("from several runs: " + "; ".join(source_lines(self)))
        if any(m is None for m in self.manifests.values()):
            problems.append(
                "with no run record: " + ", ".join(n for n, m in self.manifests.items() if m is None)
            )
        if self.conflicts():
            problems.append("measuring different weights: " + "; ".join(self.conflicts()))
        if problems:
            raise MixedRunsError("report files " + "; ".join(problems))


def source_lines(sources: RunSources) -> list[str]:
    """One line per source run: ``stage_metrics.json, operating_point.json: run 1a2b3c4d (...)``."""
    return [
        f"{', '.join(files)}: {NO_RECORD} (written before run manifests, or by hand)"
        if manifest is None
        else f"{', '.join(files)}: {manifest.label()}"
        for manifest, files in sources.runs()
    ]


def load_reports(folder: Path | str, names: Iterable[str], required: Iterable[str] = ()) -> RunSources:
    """Read report files `names` from `folder` (`data/08_reporting`): an absent optional file gives
    None, an absent required one `ReportFileError` naming it."""
    folder, required = Path(folder), set(required)
    data: dict[str, Any] = {}
    manifests: dict[str, RunManifest | None] = {}
    for name in names:
        path = folder / name
        if not path.exists():
            if name in required:
                raise ReportFileError(
                    f"{path}: not found; `make run` writes it (the results come from a run)"
                )
            data[name] = None
            continue
        data[name], manifests[name] = read_report(path)
    return RunSources(data, manifests, folder)
