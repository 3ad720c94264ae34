"""The retrain pipeline's first node: retrain, or stop here (`core.tracking.retrain_decision`).

`decide_retrain` makes the decision `python -m diffusion_gr2 retrain` makes, through the same function.
How the run then stops depends on what runs it: the Airflow task of this node reads the decision and
skips itself, so Airflow skips every task after it (`airflow_task.run_nodes`); in one Kedro run, which
has no way to end early but an exception, the ingest node after it raises `NothingToRetrain`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from mlflow import MlflowClient

from diffusion_gr2.core.tracking.ingest import IngestConfig
from diffusion_gr2.core.tracking.retrain_decision import NothingToRetrain
from diffusion_gr2.core.tracking.retrain_decision import decide_retrain as decide

DECISION_NODE = "decide_retrain"
DECISION = "retrain_decision"  # the dataset: conf/airflow/ writes it to a file for the next task


def decide_retrain(params: dict[str, Any]) -> dict[str, Any]:
    """Retrain on new rows, with no champion yet, or when `retrain.force`; else take the files in, say why."""
    config = IngestConfig(**params["ingest"])
    # `force` may be absent from an older conf: a retrain is forced only when asked for
    return asdict(decide(config, params["lock_file"], bool(params.get("force", False)), MlflowClient()))


def after_decision(take_in: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """The ingest node, run only when the decision is to retrain (else the Kedro run stops here)."""

    def take_in_incoming(params: dict[str, Any], retrain_decision: dict[str, Any]) -> dict[str, Any]:
        if not retrain_decision["retrain"]:
            raise NothingToRetrain(
                f"{retrain_decision['reason']}; nothing trained or registered "
                "(to retrain anyway: --params retrain.force=true)"
            )
        return take_in(params)

    take_in_incoming.__doc__ = take_in.__doc__
    return take_in_incoming
