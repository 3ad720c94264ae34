"""Every pipeline name the Makefile, the docs and the CLI run resolves under Kedro's lazy loading.

`kedro run --pipelines X` loads only the folders named X (`pipelines.set_requested`): a name that is
an entry added in `register_pipelines`, not a folder, fails there (`make register` once did).
"""

from __future__ import annotations

import re

import pytest
from kedro.framework.project import configure_project, pipelines

from diffusion_gr2.pipelines import DEFAULT_STAGES
from tests.conftest import PROJECT_ROOT


def names_run_by_the_makefile() -> set[str]:
    text = (PROJECT_ROOT / "Makefile").read_text()
    return {name for group in re.findall(r"--pipelines ([\w,]+)", text) for name in group.split(",") if name}


@pytest.mark.parametrize(
    "name",
    sorted(
        {"__default__", "retrain", "register", "rerank", "benchmark", *DEFAULT_STAGES}
        | names_run_by_the_makefile()
    ),
)
def test_a_requested_pipeline_loads_on_its_own(name: str) -> None:
    configure_project("diffusion_gr2")
    try:
        pipelines.set_requested([name])
        assert pipelines[name].nodes
    finally:
        pipelines.set_requested(None)


def test_retrain_and_register_are_the_pipelines_the_docs_describe() -> None:
    configure_project("diffusion_gr2")
    pipelines.set_requested(["retrain", "register"])
    try:
        retrain = {n.name for n in pipelines["retrain"].nodes}
        register = {n.name for n in pipelines["register"].nodes}
    finally:
        pipelines.set_requested(None)
    assert {"take_in_incoming", "plan_warm_start", "prepare_dataset", "train_diffusion_rl"} <= retrain
    assert register == {"register_models", "gate_requests", "run_gate"} and register <= retrain
