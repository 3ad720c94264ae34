"""rerank pipeline (`kedro run --pipelines rerank`): batch re-ranking, the served model over request files."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
