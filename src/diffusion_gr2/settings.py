"""Kedro project settings."""

from __future__ import annotations

import os

from kedro.config import OmegaConfigLoader

from diffusion_gr2.core.env import quiet_offline_environment
from diffusion_gr2.core.lineage.lineage import DigestCache
from diffusion_gr2.hooks import (
    BoundarySchemaHooks,
    LaunchHooks,
    LineageHooks,
    NodeLineageHooks,
    NodeTimingHooks,
    RunManifestHooks,
)

quiet_offline_environment()

_DIGESTS = DigestCache()  # one per process: the lineage and the run manifest hash each model folder once
HOOKS = (
    LaunchHooks(),
    LineageHooks(),
    NodeLineageHooks(_DIGESTS),
    BoundarySchemaHooks(),
    NodeTimingHooks(),
    RunManifestHooks(_DIGESTS),
)

# In a launch of several processes only rank 0 talks to MLflow: one kedro-mlflow run per launch, and
# no race between processes creating the store (docs/distributed.md).
DISABLE_HOOKS_FOR_PLUGINS = ("kedro_mlflow", "kedro-mlflow") if int(os.environ.get("RANK", "0")) > 0 else ()

CONFIG_LOADER_CLASS = OmegaConfigLoader
CONFIG_LOADER_ARGS = {
    "base_env": "base",
    "default_run_env": "local",
    # An environment (conf/smoke, conf/gpu, conf/airflow, conf/local) holds only what it changes:
    # its parameters are merged into base's key by key (Kedro's soft merge), not block by block, so a
    # block it names keeps every base key it does not (tests/test_config.py checks each env's files).
    "merge_strategy": {"parameters": "soft"},
    # `${env:NAME,default}` lets conf/ read overrides such as MLFLOW_TRACKING_URI.
    "custom_resolvers": {"env": lambda name, default=None: os.environ.get(name, default)},
}
