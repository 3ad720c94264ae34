"""Kedro project settings."""

from __future__ import annotations

import os

from kedro.config import OmegaConfigLoader

from diffusion_gr2.core.env import quiet_offline_environment
from diffusion_gr2.hooks import BoundarySchemaHooks, LineageHooks, NodeLineageHooks, NodeTimingHooks

quiet_offline_environment()

HOOKS = (LineageHooks(), NodeLineageHooks(), BoundarySchemaHooks(), NodeTimingHooks())

CONFIG_LOADER_CLASS = OmegaConfigLoader
CONFIG_LOADER_ARGS = {
    "base_env": "base",
    "default_run_env": "local",
    # `${env:NAME,default}` lets conf/ read overrides such as MLFLOW_TRACKING_URI.
    "custom_resolvers": {"env": lambda name, default=None: os.environ.get(name, default)},
}
