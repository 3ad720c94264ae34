"""Lineage: the node hook records inputs/outputs with hashes; the walk goes back to the raw file across runs."""

from __future__ import annotations

import warnings
from pathlib import Path

import mlflow
import pytest
from kedro.framework.hooks.manager import _create_hook_manager
from kedro.io import DataCatalog, MemoryDataset
from kedro.pipeline import Node, Pipeline
from kedro.runner import SequentialRunner
from kedro_datasets.text import TextDataset

from diffusion_gr2.core.lineage.lineage_report import lineage_lines
from diffusion_gr2.hooks import NodeLineageHooks


def clean(text: str) -> str:
    return text.upper()


def fit(text: str, params: dict) -> str:
    return f"weights of {len(text)} chars x {params['scale']}"


def run(pipeline: Pipeline, catalog: DataCatalog, name: str) -> str:
    hooks = _create_hook_manager()
    hooks.register(NodeLineageHooks())
    with mlflow.start_run(run_name=name) as active:
        mlflow.set_tags({"git_commit": "abc123def456", "pipeline": name})
        mlflow.log_params({"toy.scale": 3, "toy.seed": 1})
        mlflow.log_metric("toy.loss", 0.25)
        SequentialRunner().run(pipeline, catalog, hooks)
    return active.info.run_id


def test_lineage_walks_from_a_registered_version_to_the_raw_file_and_flags_a_change(
    store: str, tmp_path: Path
) -> None:
    raw, cleaned, model = tmp_path / "01_raw" / "toy.txt", tmp_path / "clean.txt", tmp_path / "model.txt"
    raw.parent.mkdir()
    raw.write_text("three users, five items")
    catalog = DataCatalog(
        {
            "raw_text": TextDataset(filepath=str(raw)),
            "clean_text": TextDataset(filepath=str(cleaned)),
            "model_toy": TextDataset(filepath=str(model)),
            "params:toy": MemoryDataset({"scale": 3}),
        }
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = run(Pipeline([Node(clean, "raw_text", "clean_text", name="clean_node")]), catalog, "prep")
        second = run(
            Pipeline([Node(fit, ["clean_text", "params:toy"], "model_toy", name="fit_node")]),
            catalog,
            "train",
        )
    # a local input is one MLflow source: no "interpreted in multiple ways" warning in every node's log
    assert not [w for w in caught if "interpreted in multiple ways" in str(w.message)]
    client = mlflow.MlflowClient()
    inputs = client.get_run(second).inputs.dataset_inputs
    assert [(i.dataset.name, i.tags[0].value if i.tags else None) for i in inputs][0][0] == "clean_text"
    assert inputs[0].dataset.source_type == "local" and str(cleaned) in inputs[0].dataset.source
    client.create_registered_model("toy")
    version = client.create_model_version("toy", f"runs:/{second}/model", run_id=second).version
    from diffusion_gr2.core.lineage.lineage import DigestCache

    for key, value in {
        "lineage.model.name": "model_toy",
        "lineage.model.path": str(model),
        "lineage.model.digest": DigestCache().digest(model),
        "lineage.model.run_id": second,
    }.items():
        client.set_model_version_tag("toy", version, key, value)
    client.set_registered_model_alias("toy", "champion", version)

    text = "\n".join(lineage_lines(client, "models:/toy@champion", tmp_path))
    assert f"node fit_node  run {second}  git abc123def456" in text
    assert f"node clean_node  run {first}" in text  # the input came from the other run
    assert "params: toy.seed=1" in text and "metrics: toy.loss=0.25" in text
    assert "raw_text" in text and "(raw file)" in text and "every hash matches the disk" in text

    # a later run of the pipeline rewrites the cleaned file: expected, and said so
    run(Pipeline([Node(str.title, "raw_text", "clean_text", name="clean_again")]), catalog, "prep-again")
    text = "\n".join(lineage_lines(client, "models:/toy@champion", tmp_path))
    assert "superseded (now" in text.split("- clean_text")[1].splitlines()[0]
    assert (
        text.splitlines()[-1]
        == "no input was edited outside the pipeline; 1 rewritten since by later runs of the pipeline"
    )

    raw.write_text("three users, six items")  # the raw file changed since the model was made
    text = "\n".join(lineage_lines(client, "models:/toy@champion", tmp_path))
    assert "CHANGED on disk" in text.split("raw_text")[1].splitlines()[0]
    assert "1 input(s) no longer match" in text and "1 rewritten since" in text
    by_run = "\n".join(lineage_lines(client, second, tmp_path))
    assert "model_toy" in by_run and "clean_node" in by_run


def test_a_warm_retrain_shows_the_settings_it_applied() -> None:
    from types import SimpleNamespace

    from diffusion_gr2.core.lineage.lineage_report import _key_params

    params = {"cft.train.max_steps": "450", "cft.train.seed": "0", "cft.warm_start.train.max_steps": "120"}
    run = SimpleNamespace(data=SimpleNamespace(params=params))
    shown = _key_params(run, {"params": ["params:cft"]})
    assert shown == ["cft.train.seed=0", "cft.warm_start.train.max_steps=120"]


def test_the_run_record_names_the_commit_the_run_started_from(tmp_path: Path, monkeypatch) -> None:
    """A commit made while a run goes on is not what it ran: node_times.json keeps the start's."""
    import json

    from diffusion_gr2 import hooks

    commits = iter(
        [{"git_commit": "start", "git_dirty": "false"}, {"git_commit": "later", "git_dirty": "false"}]
    )
    monkeypatch.setattr(hooks, "git_commit", lambda _project: next(commits))
    (tmp_path / "data/08_reporting").mkdir(parents=True)
    timing = hooks.NodeTimingHooks()
    timing.before_pipeline_run({"project_path": str(tmp_path)})
    node = Node(lambda x: x, "a", "b", name="work")
    timing.before_node_run(node)
    timing.after_node_run(node)
    timing.after_pipeline_run({"project_path": str(tmp_path)})
    record = json.loads((tmp_path / "data/08_reporting/node_times.json").read_text())
    assert record["run"]["git_commit"] == "start" and list(record["nodes_s"]) == ["work"]


@pytest.mark.parametrize(
    ("run_params", "written"),
    [
        ({}, "node_times.json"),
        ({"pipeline_names": ["benchmark"]}, "node_times.benchmark.json"),
        ({"node_names": ["work"]}, "node_times.partial.json"),
        ({"from_nodes": ["work"]}, "node_times.partial.json"),
        ({"pipeline_names": ["benchmark"], "tags": ["t"]}, "node_times.benchmark.partial.json"),
    ],
)
def test_only_a_whole_default_run_writes_the_run_record(
    tmp_path: Path, monkeypatch, run_params: dict, written: str
) -> None:
    """A named pipeline or part of a pipeline never overwrites node_times.json, the default run's record
    that `make results` prints beside its table."""
    from diffusion_gr2 import hooks

    monkeypatch.setattr(hooks, "git_commit", lambda _project: {"git_commit": "c", "git_dirty": "false"})
    reports = tmp_path / "data/08_reporting"
    reports.mkdir(parents=True)
    timing = hooks.NodeTimingHooks()
    timing.before_pipeline_run({"project_path": str(tmp_path)})
    node = Node(lambda x: x, "a", "b", name="work")
    timing.before_node_run(node)
    timing.after_node_run(node)
    timing.after_pipeline_run({"project_path": str(tmp_path), **run_params})
    assert sorted(p.name for p in reports.iterdir()) == [written]
