"""Project pipelines: one folder per stage under ``pipelines/`` (DESIGN §2, §10)."""

from __future__ import annotations

from kedro.framework.project import find_pipelines
from kedro.pipeline import Pipeline

from diffusion_gr2.pipelines import DEFAULT_STAGES
from diffusion_gr2.pipelines.retrain import registration_pipeline, retrain_pipeline


def register_pipelines() -> dict[str, Pipeline]:
    pipelines = find_pipelines(raise_errors=True)
    pipelines["__default__"] = sum(
        (pipelines[name] for name in DEFAULT_STAGES if name in pipelines), Pipeline([])
    )
    # retrain reruns the training stages between its ingest and its gate; register is the last part alone.
    pipelines["retrain"] = retrain_pipeline()
    pipelines["register"] = registration_pipeline()
    return pipelines
