"""`python -m diffusion_gr2 lineage TARGET`: the chain from a model back to the raw files
(docs/operations.md#lineage).

TARGET is a registered version (``models:/diffusion-gr2@champion``, ``models:/diffusion-gr2/3``) or
an MLflow run id. The walk starts from the hashes the target names (a version: its model folder; a
run: every output of its nodes that no node of the run read) and follows each hash to the node that
wrote it, using the node records `lineage.log_record` stored on the runs: first within the same
run, then any run tagged as having produced that hash. Each node is printed with its run, git
commit, key parameters and metrics; each input with its hash and whether the file on disk still has
it (``CHANGED`` or ``MISSING`` otherwise; ``superseded`` when a later run of the pipeline wrote
what is there now, as a retrain does). Inputs nobody produced are the raw files. A model, version,
alias or run the store does not hold raises `NotFoundError`, naming it; a TARGET of neither form
raises `MalformedTargetError`, naming the forms.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Run
from mlflow.entities.model_registry import ModelVersion

from diffusion_gr2.core.lineage.lineage import NODES_ARTIFACT_DIR, PRODUCED_TAG, DigestCache
from diffusion_gr2.core.runs.mlflow_utils import get_run, model_version, version_by_alias

__all__ = [
    "KEY_PARAM_WORDS",
    "MODEL_URI_FORMS",
    "Lineage",
    "MalformedTargetError",
    "check_target",
    "lineage_lines",
    "raw_inputs",
    "resolve_target",
]

# Parameters worth a line in the printout (the rest are in the MLflow UI).
KEY_PARAM_WORDS = (
    "max_steps",
    "lr",
    "learning_rate",
    "block_size",
    "seed",
    "k_core",
    "dataset",
    "taus",
    "n_items",
)
MAX_PARAMS, MAX_METRICS = 6, 6


@dataclass
class Lineage:
    """Node records of the runs seen so far, and which (run, node) already printed."""

    client: MlflowClient
    root: Path  # where relative paths in the records are resolved (the project root)
    digests: DigestCache = field(default_factory=DigestCache)
    _records: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    _runs: dict[str, Run] = field(default_factory=dict)
    _printed: set[tuple[str, str]] = field(default_factory=set)
    _writers: dict[str, str | None] = field(default_factory=dict)
    _experiments: list[str] | None = None

    def experiments(self) -> list[str]:
        """Every experiment id of the store, looked up once per walk."""
        if self._experiments is None:
            self._experiments = [e.experiment_id for e in self.client.search_experiments()]
        return self._experiments

    def run(self, run_id: str) -> Run:
        if run_id not in self._runs:
            self._runs[run_id] = self.client.get_run(run_id)
        return self._runs[run_id]

    def records(self, run_id: str) -> dict[str, dict[str, Any]]:
        """``node -> record`` of one run (downloaded once)."""
        if run_id not in self._records:
            found: dict[str, dict[str, Any]] = {}
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    local = self.client.download_artifacts(run_id, NODES_ARTIFACT_DIR, tmp)
                except Exception:  # a run without node records (older, or not a Kedro run)
                    local = None
                if local is not None:
                    for path in sorted(Path(local).glob("*.json")):
                        record = json.loads(path.read_text())
                        found[record["node"]] = record
            self._records[run_id] = found
        return self._records[run_id]

    def producer(self, name: str, digest: str, prefer_run: str | None) -> tuple[str, dict[str, Any]] | None:
        """(run id, node record) that wrote `name` with hash `digest`: the preferred run first, then tagged runs.

        The name must match too: two stages can write byte-identical folders (an RL stage that made
        no update leaves its input's weights), and only the name says which one was read.
        """
        candidates = [prefer_run] if prefer_run else []
        tag = f"tags.`{PRODUCED_TAG}{digest}`"
        runs = self.client.search_runs(
            self.experiments(), f"{tag} != ''", order_by=["attributes.start_time DESC"]
        )
        candidates += [r.info.run_id for r in runs]
        for run_id in candidates:
            for record in self.records(run_id).values():
                if record["outputs"].get(name, {}).get("digest") == digest:
                    return run_id, record
        return None

    def disk_state(self, entry: dict[str, Any]) -> str:
        """``ok``, ``CHANGED (now <md5>)`` or ``MISSING``: the file on disk against the recorded hash."""
        if entry.get("path") is None:
            return "in memory"
        path = Path(entry["path"])
        now = self.digests.digest(path if path.is_absolute() else self.root / path)
        if now is None:
            return "MISSING on disk"
        if now == entry["digest"]:
            return "ok"
        # A later run of the pipeline rewrote the file (a retrain does): expected, unlike an edit.
        writer = self.writer(now)
        if writer is not None:
            return f"superseded (now {now[:12]}, written by run {writer[:12]})"
        return f"CHANGED on disk (now {now[:12]})"

    def writer(self, digest: str) -> str | None:
        """The newest run tagged as having produced `digest`, or None."""
        if digest not in self._writers:
            runs = self.client.search_runs(
                self.experiments(),
                f"tags.`{PRODUCED_TAG}{digest}` != ''",
                order_by=["attributes.start_time DESC"],
                max_results=1,
            )
            self._writers[digest] = runs[0].info.run_id if runs else None
        return self._writers[digest]


def _short(digest: str | None) -> str:
    return "-" if digest is None else digest[:12] + (".dir" if digest.endswith(".dir") else "")


def _prefixes(record: dict[str, Any]) -> list[str]:
    return [p.removeprefix("params:").split(".")[0] + "." for p in record.get("params", [])]


def _key_params(run: Run, record: dict[str, Any]) -> list[str]:
    prefixes = _prefixes(record)
    own = sorted(k for k in run.data.params if any(k.startswith(p) for p in prefixes))
    # a warm retrain logs what it applied as `<stage>.warm_start.train.*`: that replaces `<stage>.train.*`
    applied = {k.replace(".warm_start.train.", ".train.", 1) for k in own if ".warm_start.train." in k}
    own = [k for k in own if k not in applied]
    key = [k for k in own if any(w in k.rsplit(".", 1)[-1] for w in KEY_PARAM_WORDS)] or own
    return [f"{k}={run.data.params[k]}" for k in key[:MAX_PARAMS]]


def _key_metrics(run: Run, record: dict[str, Any]) -> list[str]:
    prefixes = _prefixes(record)
    own = sorted(k for k in run.data.metrics if any(k.startswith(p) for p in prefixes))
    return [f"{k}={run.data.metrics[k]:.4g}" for k in own[:MAX_METRICS]]


def _node_lines(lineage: Lineage, run_id: str, record: dict[str, Any], indent: str) -> Iterator[str]:
    run = lineage.run(run_id)
    tags = run.data.tags
    commit = tags.get("git_commit", "unknown")[:12] + (" (dirty)" if tags.get("git_dirty") == "true" else "")
    yield f"{indent}node {record['node']}  run {run_id}  git {commit}  pipeline {tags.get('pipeline', '?')}"
    if params := _key_params(run, record):
        yield f"{indent}  params: {', '.join(params)}"
    if metrics := _key_metrics(run, record):
        yield f"{indent}  metrics: {', '.join(metrics)}"


def walk(lineage: Lineage, name: str, entry: dict[str, Any], run_id: str | None, depth: int) -> Iterator[str]:
    """Lines for one artifact (`name` with its recorded hash) and, recursively, what it was made from."""
    indent = "  " * depth
    digest = entry.get("digest")
    yield f"{indent}- {name}  md5 {_short(digest)}  [{lineage.disk_state(entry)}]  {entry.get('path') or ''}"
    if digest is None:
        return
    found = lineage.producer(name, digest, run_id)
    if found is None:
        kind = (
            "raw file"
            if name.startswith("raw/") or "01_raw" in str(entry.get("path"))
            else "no producer on record"
        )
        yield f"{indent}  ({kind})"
        return
    producer_run, record = found
    key = (producer_run, record["node"])
    if key in lineage._printed:
        yield f"{indent}  <- node {record['node']} of run {producer_run} (shown above)"
        return
    lineage._printed.add(key)
    yield from _node_lines(lineage, producer_run, record, indent + "  <- ")
    for child, child_entry in sorted(record["inputs"].items()):
        yield from walk(lineage, child, child_entry, producer_run, depth + 2)


MODEL_URI_FORMS = "models:/NAME@ALIAS or models:/NAME/VERSION (VERSION a number)"


class MalformedTargetError(ValueError):
    """A TARGET that is neither a model URI nor a run id of the forms taken; the message says which.

    Not a `NotFoundError`: nothing was looked up. The operations commands print it as one line too.
    """


# MLflow refuses "/" and ":" in a model name; "@" would make the alias ambiguous
_MODEL_URI = re.compile(r"models:/(?P<name>[^/:@]+)(?:@(?P<alias>[^/:@]+)|/(?P<version>\d+))")
_RUN_ID = re.compile(r"[a-zA-Z0-9][\w\-]{0,255}")  # MLflow's own run id rule (mlflow.utils.validation)


def check_target(target: str) -> None:
    """`MalformedTargetError` unless `target` has a form `lineage` takes; nothing is looked up."""
    if target.startswith("models:"):
        if _MODEL_URI.fullmatch(target) is None:
            raise MalformedTargetError(f"malformed model URI {target!r}: expected {MODEL_URI_FORMS}")
    elif _RUN_ID.fullmatch(target) is None:  # MLflow would answer with a traceback of its own
        raise MalformedTargetError(
            f"malformed lineage target {target!r}: expected {MODEL_URI_FORMS}, or an MLflow run id "
            "(letters, digits, _ and -)"
        )


def _target_version(client: MlflowClient, target: str) -> ModelVersion:
    """The version a well-formed `models:` target names (`NotFoundError` when the store lacks it)."""
    match = _MODEL_URI.fullmatch(target)
    assert match is not None  # check_target ran first
    if match["alias"] is not None:
        return version_by_alias(client, match["name"], match["alias"])
    return model_version(client, match["name"], match["version"])


def _no_model_folder(name: str, version: str, tags: dict[str, str], run_id: str | None) -> str:
    """The line for a version with no model folder on record: the pre-rank (the retriever's order has
    no weights) or a version registered outside a Kedro run; where its catalogue's run is."""
    if tags.get("system") == "prerank":
        why = f"{name} v{version} is the retriever's order: no model folder, no weights"
    else:
        why = (
            f"{name} v{version} has no model folder on record "
            "(no lineage.model tags: registered outside a Kedro run)"
        )
    return why + (f"; the run that registered it: `lineage {run_id}`" if run_id else "")


def resolve_target(client: MlflowClient, target: str) -> tuple[list[str], str, dict[str, dict[str, Any]]]:
    """Header lines, the run to start in, and the starting artifacts (``name -> {path, digest}``)."""
    check_target(target)
    if target.startswith("models:"):
        mv = _target_version(client, target)
        tags = mv.tags
        header = [
            f"{mv.name} version {mv.version}  aliases {sorted(getattr(mv, 'aliases', []) or [])}  "
            f"run {mv.run_id}  system {tags.get('system', '?')}  tau {tags.get('operating_point.tau', '?')}  "
            f"window {tags.get('operating_point.window', '?')}  gate {tags.get('gate.decision', '-')}"
        ]
        run_id = tags.get("lineage.model.run_id") or mv.run_id
        if not tags.get("lineage.model.digest"):  # nothing to walk back from: say why, not "[in memory]"
            return [*header, _no_model_folder(mv.name, mv.version, tags, run_id)], run_id, {}
        start = {
            tags.get("lineage.model.name", "model"): {
                "path": tags.get("lineage.model.path"),
                "digest": tags.get("lineage.model.digest"),
            }
        }
        return header, run_id, start
    get_run(client, target)  # a wrong id would otherwise read as a run with no node records
    lineage = Lineage(client, Path.cwd())
    records = lineage.records(target)
    read = {e["digest"] for r in records.values() for e in r["inputs"].values()}
    start = {
        name: entry
        for r in records.values()
        for name, entry in r["outputs"].items()
        if entry["digest"] is not None and entry["digest"] not in read
    }
    return [f"run {target}: {len(records)} nodes recorded, {len(start)} final outputs"], target, start


def lineage_lines(client: MlflowClient, target: str, root: Path | None = None) -> list[str]:
    """The whole printout for `target` (see the module docstring)."""
    header, run_id, start = resolve_target(client, target)
    lineage = Lineage(client, root or Path.cwd())
    lines = list(header)
    if not start:  # nothing recorded to walk (the header says why): no hash to compare either
        return lines
    for name, entry in sorted(start.items()):
        lines += list(walk(lineage, name, entry, run_id, 0))
    changed = sum("CHANGED" in line or "MISSING" in line for line in lines)
    superseded = sum("superseded (now" in line for line in lines)
    later = f"{superseded} rewritten since by later runs of the pipeline" if superseded else ""
    if changed:
        lines.append(f"{changed} input(s) no longer match the file on disk" + (f"; {later}" if later else ""))
    else:
        lines.append(
            f"no input was edited outside the pipeline; {later}" if later else "every hash matches the disk"
        )
    return lines


def raw_inputs(client: MlflowClient, name: str, version: str) -> dict[str, dict[str, Any]]:
    """The raw files a registered version was trained on (``raw/<file> -> {path, digest}``), as recorded.

    Walks the node records back from the version's model folder as `lineage` does, without printing,
    and keeps the inputs named ``raw/...`` (what `data_prep` read). Empty when the version carries no
    lineage tags or its runs no node records (a version registered outside a Kedro run).
    """
    tags = model_version(client, name, version).tags
    digest = tags.get("lineage.model.digest")
    if not digest:
        return {}
    lineage = Lineage(client, Path.cwd())
    queue = [(tags.get("lineage.model.name", "model"), digest, tags.get("lineage.model.run_id"))]
    seen: set[tuple[str, str]] = set()
    found: dict[str, dict[str, Any]] = {}
    while queue:
        artifact, artifact_digest, run_id = queue.pop()
        producer = lineage.producer(artifact, artifact_digest, run_id)
        if producer is None or (producer[0], producer[1]["node"]) in seen:
            continue
        seen.add((producer[0], producer[1]["node"]))
        for child, entry in producer[1]["inputs"].items():
            if child.startswith("raw/"):
                found[child] = {"path": entry.get("path"), "digest": entry.get("digest")}
            elif entry.get("digest"):
                queue.append((child, entry["digest"], producer[0]))
    return dict(sorted(found.items()))
