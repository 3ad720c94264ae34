"""Kedro hooks: lineage tags on the MLflow run that kedro-mlflow opens for each ``kedro run``, every
node's input and output hashes on that run, and schema checks on boundary datasets as they are loaded."""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import mlflow
from kedro.framework.hooks import hook_impl

from diffusion_gr2.core.base import manifest
from diffusion_gr2.core.lineage.lineage import (
    DigestCache,
    NodeRecord,
    add_output,
    dvc_hashes,
    git_commit,
    input_record,
    log_record,
    machine,
)

logger = logging.getLogger(__name__)


class LaunchHooks:
    """Refuse, before any node runs, a launch that cannot work: a plain ``kedro run`` started as several
    processes (``torchrun -m kedro run``: each would run every node and write every output; such
    launches go through ``-m diffusion_gr2 run``)."""

    @hook_impl
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline: Any) -> None:
        from diffusion_gr2.runner import RankAwareRunner, launch_size

        runner = str(run_params.get("runner", ""))
        if launch_size() > 1 and RankAwareRunner.__name__ not in runner:
            raise RuntimeError(
                f"this is one of {launch_size()} processes (WORLD_SIZE) but the runner is {runner}: launch "
                "with `accelerate launch [--config_file conf/accelerate/X.yaml] -m diffusion_gr2 run ...` "
                "(docs/distributed.md)"
            )


class LineageHooks:
    """Tags each run with git commit, DVC hashes, pipeline and environment (docs/operations.md#lineage)."""

    @hook_impl
    def before_pipeline_run(self, run_params: dict[str, Any]) -> None:
        # kedro-mlflow's own hook (a plugin, so called before project hooks) has opened the run.
        if mlflow.active_run() is None:
            logger.info("No active MLflow run: lineage tags not written")
            return
        project_dir = Path(run_params.get("project_path") or Path.cwd())
        pipelines = run_params.get("pipeline_names") or [run_params.get("pipeline_name") or "__default__"]
        tags = {
            "pipeline": ",".join(str(p) for p in pipelines if p) or "__default__",
            "kedro_env": str(run_params.get("env") or "local"),
            **git_commit(project_dir),
            **dvc_hashes(project_dir),
        }
        mlflow.set_tags(tags)


class BoundarySchemaHooks:
    """Validate boundary datasets whenever a node loads them, not only where they are written.

    ``requests`` is read by every model stage (RL, OPD, inference, benchmark); a file edited or
    produced elsewhere (retraining feeds outside data) must fail here, naming the row and the rule,
    rather than deep inside decoding with a bare ``zip()`` or ``IndexError`` message.
    """

    DATASETS = ("requests",)

    @hook_impl
    def after_dataset_loaded(self, dataset_name: str, data: Any) -> None:
        if dataset_name in self.DATASETS:
            from diffusion_gr2.core.data.schemas import validate_requests  # pandera: only when needed

            validate_requests(data)


def dataset_path(catalog: Any, name: str) -> Path | None:
    """The file or folder behind catalog entry `name`, or None (memory, metrics, parameters)."""
    if name.startswith("params:") or name == "parameters":
        return None
    dataset = catalog.get(name)
    path = getattr(dataset, "_filepath", None) or getattr(dataset, "_path", None)
    return None if path is None else Path(str(path))


def raw_files(params: Any) -> dict[str, Path]:
    """The raw files `data_prep` reads (its only input is its parameters): ``raw/<name> -> path``."""
    from diffusion_gr2.core.data.readers import detect_format, resolve_raw_folder

    if not isinstance(params, dict) or "dataset" not in params:
        return {}
    try:
        detected = detect_format(resolve_raw_folder(params["dataset"], params.get("raw_root", "data/01_raw")))
    except (FileNotFoundError, ValueError):
        return {}
    files = [*detected.interaction_files, *detected.metadata_files]
    return {f"raw/{path.name}": path for path in files}


class NodeLineageHooks:
    """Name every node's inputs and outputs, with content hashes, on the active MLflow run
    (docs/operations.md#lineage).

        Inputs are hashed before the node runs and outputs after Kedro saved them (``after_node_run``
        comes before the saves); the record is written once the node's last output is saved. Raw files
        read by ``data_prep`` (its only input is ``params:data_prep``) are named as inputs too, and so are the
    champion folders a warm retrain's nodes read (named as their producer wrote them, so the lineage
    walk crosses into the run that trained the champion).
    """

    RAW_PARAMS = ("params:data_prep",)

    def __init__(self, digests: DigestCache | None = None) -> None:
        self._digests = digests or DigestCache()
        self._catalog: Any = None
        self._pending: dict[str, tuple[NodeRecord, set[str]]] = {}

    @hook_impl
    def after_catalog_created(self, catalog: Any) -> None:
        self._catalog, self._pending = catalog, {}  # `after_dataset_saved` is not given the catalog

    @hook_impl
    def before_node_run(self, node: Any, catalog: Any, inputs: dict[str, Any]) -> None:
        if mlflow.active_run() is None:
            return
        self._catalog = catalog
        files = {name: dataset_path(catalog, name) for name in node.inputs if not name.startswith("params:")}
        for name in self.RAW_PARAMS:
            if name in inputs:
                files |= raw_files(inputs[name])
        if "warm_start" in inputs:  # a warm retrain's node reading the champion's folders
            from diffusion_gr2.pipelines.retrain.warm import champion_files

            files |= champion_files(node.name, inputs["warm_start"])
        params = [name for name in node.inputs if name.startswith("params:")]
        self._pending[node.name] = (input_record(node.name, files, params, self._digests), set(node.outputs))
        if not node.outputs:
            self._flush(node.name)

    @hook_impl
    def after_dataset_saved(self, dataset_name: str, node: Any) -> None:
        pending = self._pending.get(getattr(node, "name", ""))
        if pending is None or self._catalog is None:
            return
        record, waiting = pending
        add_output(record, dataset_name, dataset_path(self._catalog, dataset_name), self._digests)
        waiting.discard(dataset_name)
        if not waiting:
            self._flush(node.name)

    def _flush(self, node_name: str) -> None:
        record, _ = self._pending.pop(node_name)
        try:
            log_record(record)
        except Exception as err:  # lineage must never fail a training run; it says so instead
            logger.warning("lineage of node %s not logged: %s", node_name, err)


class RunManifestHooks:
    """Open the run context every report file is stamped from (`core.base.manifest`).

    Before the first node: the MLflow run id (kedro-mlflow's hook, a plugin, has opened the run), the
    commit the run starts from, the environment, the pipelines asked for and whether only part of them
    runs, the start time and the machine. Before each node: the digests of the model folders it loads
    (``model_*`` inputs), so a report names the weights it measured. `RunReportDataset` stamps what
    it saves from this context; nodes never see it. The context closes when the run ends or fails.
    """

    def __init__(self, digests: DigestCache | None = None) -> None:
        self._digests = digests or DigestCache()  # shared with NodeLineageHooks: each folder hashed once

    @hook_impl
    def before_pipeline_run(self, run_params: dict[str, Any]) -> None:
        active = mlflow.active_run()
        project = Path(run_params.get("project_path") or Path.cwd())
        asked = run_params.get("pipeline_names") or [run_params.get("pipeline_name")]
        commit = git_commit(project)
        manifest.begin_run(
            manifest.RunManifest(
                run_id=None if active is None else active.info.run_id,
                git_commit=commit["git_commit"],
                git_dirty=commit["git_dirty"] == "true",
                env=str(run_params.get("env") or "local"),
                pipelines=tuple(str(p) for p in asked if p) or ("__default__",),
                partial=any(run_params.get(key) for key in NodeTimingHooks.PART_FILTERS),
                started=datetime.now(UTC).isoformat(timespec="seconds"),
                machine=machine(),
            )
        )

    @hook_impl
    def before_node_run(self, node: Any, catalog: Any) -> None:
        models = {
            name: self._digests.digest(dataset_path(catalog, name))
            for name in node.inputs
            if name.startswith("model_")
        }
        manifest.note_models(models, node.name)

    @hook_impl
    def after_pipeline_run(self) -> None:
        manifest.end_run()

    @hook_impl
    def on_pipeline_error(self) -> None:
        manifest.end_run()


class NodeTimingHooks:
    """Where a run's time went: each node's wall time, logged and kept with the run.

    Logs `timing.<node>_s` on the active MLflow run as each node ends, writes
    `data/08_reporting/node_times.json` (nodes slowest first, the run's total, and what ran where:
    start time, commit, environment, machine) and prints the slowest nodes at the end, so a team
    sizing the default run against its budget sees what to shrink. A run of named pipelines writes
    `node_times.<names>.json` instead, so `make benchmark` keeps the default run's record, and a run
    of part of a pipeline (`--nodes`, `--from-nodes`, `--tags`, ...) `node_times.partial.json`, so
    the record `make results` prints beside a run's table stays that run's. The record names the MLflow
    run id: `make results` finds each report's run (its manifest, `RunManifestHooks`) by it.
    """

    REPORT = Path("data/08_reporting/node_times.json")
    # Kedro's run_params that run part of a pipeline (`kedro run --nodes`, `--only-missing-outputs`, ...)
    PART_FILTERS = (
        "node_names",
        "from_nodes",
        "to_nodes",
        "from_inputs",
        "to_outputs",
        "tags",
        "namespaces",
        "only_missing_outputs",
    )

    def __init__(self) -> None:
        self._start: dict[str, float] = {}
        self._seconds: dict[str, float] = {}
        self._run_start = 0.0
        self._started = ""
        self._commit: dict[str, str] = {}
        self._run_id: str | None = None

    @hook_impl
    def before_pipeline_run(self, run_params: dict[str, Any]) -> None:
        self._start, self._seconds, self._run_start = {}, {}, time.perf_counter()
        self._started = datetime.now(UTC).isoformat(timespec="seconds")
        # the code the run started from: a commit made while it runs is not what it ran
        self._commit = git_commit(Path(run_params.get("project_path") or Path.cwd()))
        active = mlflow.active_run()  # read now: kedro-mlflow ends its run before `after_pipeline_run`
        self._run_id = None if active is None else active.info.run_id

    @hook_impl
    def before_node_run(self, node: Any) -> None:
        self._start[node.name] = time.perf_counter()

    @hook_impl
    def after_node_run(self, node: Any) -> None:
        if node.name not in self._start:
            return
        seconds = self._seconds[node.name] = time.perf_counter() - self._start.pop(node.name)
        if mlflow.active_run() is not None:  # here, not at the end: kedro-mlflow closes its run first
            try:
                mlflow.log_metric(f"timing.{node.name}_s", seconds)
            except Exception as err:  # timing must never fail a run
                logger.warning("time of node %s not logged to MLflow: %s", node.name, err)

    @hook_impl
    def after_pipeline_run(self, run_params: dict[str, Any]) -> None:
        if not self._seconds:
            return
        nodes = dict(sorted(self._seconds.items(), key=lambda kv: -kv[1]))
        total = time.perf_counter() - self._run_start
        project = Path(run_params.get("project_path") or Path.cwd())
        asked = run_params.get("pipeline_names") or [run_params.get("pipeline_name")]
        names = [str(p) for p in asked if p and p != "__default__"]
        run = {
            "run_id": self._run_id,  # what `make results` matches a report's manifest against
            "started": self._started,
            "pipelines": names or ["__default__"],
            "env": str(run_params.get("env") or "local"),
            "nodes_run": "all" if not run_params.get("node_names") else list(run_params["node_names"]),
            **(self._commit or git_commit(project)),
            **machine(),
        }
        report = {
            "total_s": round(total, 1),
            "nodes_s": {name: round(sec, 1) for name, sec in nodes.items()},
            "run": run,
        }
        path = project / self.REPORT
        if names:
            path = path.with_name(f"node_times.{'+'.join(names)}.json")
        if any(run_params.get(key) for key in self.PART_FILTERS):
            path = path.with_name(f"{path.stem}.partial.json")
        if path.parent.is_dir():
            path.write_text(json.dumps(report, indent=2) + "\n")
        top = ", ".join(f"{name} {sec / 60:.1f} min" for name, sec in list(nodes.items())[:6])
        logger.info("run took %.1f min; slowest nodes: %s", total / 60, top)
