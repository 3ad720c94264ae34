"""Lineage facts for MLflow runs: the code commit, the DVC hashes, and per-node input/output hashes
(docs/operations.md#lineage)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlflow
import yaml


def git_commit(project_dir: Path) -> dict[str, str]:
    """The checked-out commit and whether the tree has uncommitted changes ("unknown" outside git)."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=project_dir, capture_output=True, text=True, check=False, timeout=10
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit, "git_dirty": str(bool(dirty)).lower()}


def machine() -> dict[str, Any]:
    """What a run's timings were taken on: CPU cores it may use, torch's threads, the GPU or none."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu_cores": cores, "torch_threads": torch.get_num_threads(), "gpu": gpu}


def dvc_hashes(project_dir: Path) -> dict[str, str]:
    """``dvc.<stage>.<path>`` → md5 for every dependency and output recorded in ``dvc.lock``."""
    lock_path = project_dir / "dvc.lock"
    if not lock_path.exists():
        return {}
    lock = yaml.safe_load(lock_path.read_text()) or {}
    tags: dict[str, str] = {}
    for stage, entry in (lock.get("stages") or {}).items():
        for kind in ("deps", "outs"):
            for item in entry.get(kind) or []:
                digest = item.get("md5") or item.get("hash") or ""
                if digest:
                    tags[f"dvc.{stage}.{item['path']}"] = str(digest)
    return tags


# ---- per-node lineage records ------------------------------------------------------------------------
# Every node's inputs and outputs with the content hash of each file or folder, written to the MLflow
# run (docs/operations.md#lineage): inputs through `mlflow.log_input` (what the UI shows), the full record as
# the artifact `lineage/nodes/<node>.json` (what `lineage_report` walks), and one run tag per produced
# hash, `lineage.produced.<md5>`, so a later run's input can be traced to the run that wrote it.

NODES_ARTIFACT_DIR = "lineage/nodes"
PRODUCED_TAG = "lineage.produced."


def file_md5(path: Path, chunk: int = 1 << 20) -> str:
    """MD5 of a file's bytes: the hash DVC 3 records for a file in ``dvc.lock``."""
    digest = hashlib.md5()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


class DigestCache:
    """Content hashes of files and folders, memoised by (path, size, mtime) so a run hashes each once.

    A folder's hash is the MD5 of its sorted ``relative-path md5`` lines, suffixed ``.dir`` as DVC
    does for directories (the value differs from DVC's own manifest hash; it is stable and ours).
    """

    def __init__(self) -> None:
        self._files: dict[tuple[str, int, int], str] = {}

    def _file(self, path: Path) -> str:
        stat = path.stat()
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        if key not in self._files:
            self._files[key] = file_md5(path)
        return self._files[key]

    def digest(self, path: Path | str | None) -> str | None:
        """The hash of `path`, or None when there is nothing there."""
        if path is None:
            return None
        path = Path(path)
        if path.is_file():
            return self._file(path)
        if path.is_dir():
            lines = sorted(
                f"{p.relative_to(path).as_posix()} {self._file(p)}" for p in path.rglob("*") if p.is_file()
            )
            return hashlib.md5("\n".join(lines).encode()).hexdigest() + ".dir"
        return None


@dataclass
class NodeRecord:
    """One node's run: inputs and outputs as ``name -> {"path", "digest"}``; parameter names."""

    node: str
    inputs: dict[str, dict[str, str | None]] = field(default_factory=dict)
    outputs: dict[str, dict[str, str | None]] = field(default_factory=dict)
    params: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _entry(path: Path | str | None, digests: DigestCache) -> dict[str, str | None]:
    return {"path": None if path is None else str(path), "digest": digests.digest(path)}


def input_record(
    node: str, inputs: Mapping[str, Path | str | None], params: list[str], digests: DigestCache
) -> NodeRecord:
    """The record of a node about to run: its inputs hashed as they are now."""
    return NodeRecord(node, {name: _entry(p, digests) for name, p in inputs.items()}, {}, sorted(params))


def add_output(record: NodeRecord, name: str, path: Path | str | None, digests: DigestCache) -> None:
    """Add one saved output (hashed after it was written)."""
    record.outputs[name] = _entry(path, digests)


def log_record(record: NodeRecord) -> None:
    """Write `record` to the active MLflow run: dataset inputs, produced-hash tags, the JSON record."""
    if mlflow.active_run() is None:
        return
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    for name, entry in record.inputs.items():
        if entry["digest"] is None or entry["path"] is None:
            continue
        with warnings.catch_warnings():
            # A local path matches the two local artifact sources MLflow registers (schemes "" and
            # "file", one class name): the same source either way, not worth a warning a node.
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            source = resolve_dataset_source(str(Path(entry["path"]).resolve()))
        kind = "model" if name.startswith("model_") or entry["digest"].endswith(".dir") else "dataset"
        dataset = MetaDataset(source=source, name=name, digest=entry["digest"])
        mlflow.log_input(dataset, context=record.node, tags={"kind": kind})
    tags = {
        f"{PRODUCED_TAG}{entry['digest']}": name
        for name, entry in record.outputs.items()
        if entry["digest"] is not None
    }
    if tags:
        mlflow.set_tags(tags)
    mlflow.log_dict(record.as_dict(), f"{NODES_ARTIFACT_DIR}/{record.node}.json")
