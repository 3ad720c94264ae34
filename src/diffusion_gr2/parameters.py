"""The parameters as a Kedro run resolves them, outside a Kedro session (scripts, tests, notebooks).

An environment's files hold only what they change from `conf/base` (the soft merge in settings.py),
so a file of `conf/smoke` or `conf/gpu` alone is not a configuration: read it through these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kedro.config import OmegaConfigLoader

from diffusion_gr2.settings import CONFIG_LOADER_ARGS

BASE_ENV = CONFIG_LOADER_ARGS["base_env"]


def _loader(conf_source: Path, env: str | None, **kwargs: Any) -> OmegaConfigLoader:
    args = CONFIG_LOADER_ARGS | kwargs
    return OmegaConfigLoader(str(conf_source), env=env, **args)


def load_parameters(env: str | None = None, conf_source: str | Path = "conf") -> dict[str, Any]:
    """Every parameter of `env` (None: base alone), merged over base as `kedro run --env` merges them."""
    return _loader(Path(conf_source), env or BASE_ENV)["parameters"]


def file_parameters(path: str | Path) -> dict[str, Any]:
    """The parameters of one file `conf/<env>/<name>.yml` as `env` resolves them: the same-named
    file of `conf/base` with this one merged over it (a base file: itself)."""
    path = Path(path)
    env = path.parent.name
    patterns = {"parameters": [path.name]}  # this file (and base's of the same name) only
    return _loader(path.parent.parent, env, config_patterns=patterns)["parameters"]
