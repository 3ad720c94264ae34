"""The retrain pipeline's first node: retrain, or stop here (`core.monitoring.retrain_decision`).

`decide_retrain` makes the decision `python -m diffusion_gr2 retrain` makes, through the same function.
How the run then stops depends on what runs it: the Airflow task of this node reads the decision and
skips itself, so Airflow skips every task after it (`airflow_task.run_nodes`); in one Kedro run, which
has no way to end early but an exception, the ingest node after it raises `NothingToRetrain`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import mlflow
from mlflow import MlflowClient

from diffusion_gr2.core.monitoring.drift import render_html
from diffusion_gr2.core.monitoring.retrain_decision import NothingToRetrain, decide_from_params

DECISION_NODE = "decide_retrain"
DECISION = "retrain_decision"  # the dataset: conf/airflow/ writes it to a file for the next task


def decide_retrain(params: dict[str, Any]) -> dict[str, Any]:
    """Retrain on new rows, with nothing serving yet, or when `retrain.force` (or strong drift below
    the new-rows minimum); else take the files in, say why. The delivery's drift report rides along."""
    return asdict(decide_from_params(params, False, MlflowClient()))


def drift_outputs(retrain_decision: dict[str, Any]) -> dict[str, Any]:
    """drift.json and drift.html of the decided retrain, naming its run; its summary as run tags."""
    # no report: nothing was delivered (a forced retrain, or one with nothing serving yet), or
    # retrain.drift is off; the page and the tags still say which
    why = "retrain.drift.enabled is false" if retrain_decision.get("new_rows") else "no delivered rows"
    report = retrain_decision.get("drift") or {
        "judged": False,
        "summary": f"no drift report: {why} ({retrain_decision['reason']})",
    }
    run = mlflow.active_run()
    report = {
        "run_id": run.info.run_id if run else None,
        "commit": MlflowClient().get_run(run.info.run_id).data.tags.get("git_commit") if run else None,
        "trigger": retrain_decision.get("trigger"),
        **report,
    }
    if run is not None:
        mlflow.set_tags(
            {"drift.summary": report["summary"][:5000], "retrain.trigger": str(report["trigger"])}
        )
    return {"drift_report": report, "drift_html": render_html(report, "Drift report: delivery vs champion")}


def after_decision(take_in: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """The ingest node, run only when the decision is to retrain (else the Kedro run stops here); it
    also writes the delivery's drift report (`drift_outputs`)."""

    def take_in_incoming(params: dict[str, Any], retrain_decision: dict[str, Any]) -> dict[str, Any]:
        if not retrain_decision["retrain"]:
            raise NothingToRetrain(
                f"{retrain_decision['reason']}; nothing trained or registered "
                "(to retrain anyway: --params retrain.force=true)"
            )
        return {"ingest_report": take_in(params), **drift_outputs(retrain_decision)}

    take_in_incoming.__doc__ = take_in.__doc__
    return take_in_incoming
