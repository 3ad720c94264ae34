"""Project pipelines: one folder per stage under ``pipelines/``
(docs/architecture.md#names-and-report-files)."""

from __future__ import annotations

from kedro.framework.project import find_pipelines
from kedro.pipeline import Pipeline

from diffusion_gr2.pipelines import DEFAULT_STAGES


def register_pipelines() -> dict[str, Pipeline]:
    pipelines = find_pipelines(raise_errors=True)
    pipelines["__default__"] = sum(
        (pipelines[name] for name in DEFAULT_STAGES if name in pipelines), Pipeline([])
    )
    # Every other name is a folder of pipelines/ (Kedro loads only the folders a run names: `retrain`
    # and `register` are folders for that reason, not entries added here).
    return pipelines
