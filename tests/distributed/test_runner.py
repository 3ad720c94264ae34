"""What runs where in a launch, and the launches that are refused before any node runs."""

from __future__ import annotations

import pytest
from kedro.framework.startup import bootstrap_project

from diffusion_gr2.hooks import LaunchHooks
from diffusion_gr2.runner import launch_order, placement, runs_on_all_ranks
from tests.conftest import PROJECT_ROOT

TRAINING = {
    "midtrain_ar_copy",
    "train_ar_sft",
    "train_ar_ei",
    "train_ar_rl",
    "train_cft",
    "train_opd",
    "train_diffusion_rl",
    "train_distilled",
    "train_distilled_round2",
    "train_distilled_round3",
}


@pytest.fixture(scope="module")
def default_pipeline():
    bootstrap_project(PROJECT_ROOT)
    from kedro.framework.project import pipelines

    return pipelines["__default__"]


def _decoding(pipeline) -> set[str]:
    """The inference nodes of the model systems: each process decodes its share of their requests."""
    unmodelled = {"rerank_prerank", "rerank_analyst"}  # no model: rank 0
    return {n.name for n in pipeline.nodes if n.name.startswith("rerank_") and n.name not in unmodelled}


def test_training_and_decoding_nodes_run_on_every_rank_and_nothing_else_but_the_starting_model(
    default_pipeline,
) -> None:
    everywhere = {name for name, where in placement(default_pipeline) if where == "every rank"}
    assert _decoding(default_pipeline) and everywhere == TRAINING | {"build_ar_model"} | _decoding(
        default_pipeline
    )


def test_a_launch_validates_first_trains_next_and_reports_last(default_pipeline) -> None:
    order = [n.name for n in launch_order(default_pipeline)]
    assert sorted(order) == sorted(n.name for n in default_pipeline.nodes)
    position = {name: i for i, name in enumerate(order)}
    for node in default_pipeline.nodes:  # still a topological order
        for parent in default_pipeline.node_dependencies[node]:
            assert position[parent.name] < position[node.name], (parent.name, node.name)
    first_training = min(position[n] for n in TRAINING)
    last_shared = max(position[n] for n in TRAINING | _decoding(default_pipeline))
    assert max(position["validate_splits"], position["validate_candidate_lists"]) < first_training
    # the reports come after every process is done: nothing after them runs on every rank
    assert all(position[n] > last_shared for n in ("combine_rankings", "write_report"))
    assert not any(runs_on_all_ranks(n) for n in launch_order(default_pipeline)[last_shared + 1 :])


def test_a_plain_kedro_run_started_as_several_processes_is_refused(
    default_pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="accelerate launch .* -m diffusion_gr2 run"):
        LaunchHooks().before_pipeline_run({"runner": "SequentialRunner"}, default_pipeline)
    LaunchHooks().before_pipeline_run(
        {"runner": "<diffusion_gr2.runner.RankAwareRunner object>"}, default_pipeline
    )


def test_an_fsdp_launch_of_the_whole_dag_rollout_stages_included_is_not_refused(
    default_pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollout stages hold the full weights through each step under FSDP (core/train/fsdp.py,
    tests/distributed/test_fsdp_rollouts.py)."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert {"train_ar_rl", "train_opd", "train_diffusion_rl"} <= {n.name for n in default_pipeline.nodes}
    LaunchHooks().before_pipeline_run({"runner": "RankAwareRunner"}, default_pipeline)
