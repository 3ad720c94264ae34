"""Kedro hooks: lineage tags on the MLflow run that kedro-mlflow opens for each ``kedro run``, and
schema checks on boundary datasets as they are loaded."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlflow
from kedro.framework.hooks import hook_impl

from diffusion_gr2.core.tracking.lineage import dvc_hashes, git_commit

logger = logging.getLogger(__name__)


class LineageHooks:
    """Tags each run with git commit, DVC hashes, pipeline and environment (DESIGN §9)."""

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
