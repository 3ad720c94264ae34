"""Offline, quiet process environment: no telemetry, no hub downloads
(docs/operations.md#offline-and-quiet)."""

from __future__ import annotations

import os

# Each switch is a documented opt-out of the tool it names; setdefault keeps a user's explicit choice.
QUIET_OFFLINE_ENV: dict[str, str] = {
    "KEDRO_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "GX_ANALYTICS_ENABLED": "False",
    "TOKENIZERS_PARALLELISM": "false",
    "GIT_PYTHON_REFRESH": "quiet",
}


def quiet_offline_environment() -> None:
    """Switch off telemetry and network access of every library the project uses."""
    for key, value in QUIET_OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
