"""benchmark pipeline (not part of `__default__`: `kedro run --pipelines benchmark`)."""

from .pipeline import BENCHMARK_SYSTEMS, create_pipeline

__all__ = ["BENCHMARK_SYSTEMS", "create_pipeline"]
