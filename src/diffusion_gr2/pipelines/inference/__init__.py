"""inference pipeline."""

from .pipeline import SYSTEMS, create_pipeline

__all__ = ["SYSTEMS", "create_pipeline"]
