"""retrain pipeline."""

from .pipeline import create_pipeline, registration_pipeline, retrain_pipeline

__all__ = ["create_pipeline", "registration_pipeline", "retrain_pipeline"]
