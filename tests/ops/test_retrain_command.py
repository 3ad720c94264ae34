"""`python -m diffusion_gr2 retrain`: nothing new and a champion serving means no retrain at all."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest

from diffusion_gr2.__main__ import ops
from diffusion_gr2.core.data.recbole import embedded_ml100k_folder
from diffusion_gr2.core.registry import registry
from tests.conftest import make_project_copy
from tests.ops.conftest import World

HEADER = "user_id:token\titem_id:token\trating:float\ttimestamp:float"


@pytest.fixture
def project(
    store: str, world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Path, list[list[str]]]]:
    """A project copy as the working directory, a champion registered, and Kedro runs recorded."""
    root = make_project_copy(tmp_path / "project")
    monkeypatch.chdir(root)
    version = registry.register_reranker(
        registry.DIFFUSION_MODEL, world.models["rl"], world.items, world.sids, world.config("rl")
    ).version
    registry.promote(registry.DIFFUSION_MODEL, version, "test")
    (root / "data/01_raw/incoming").mkdir(parents=True)
    runs: list[list[str]] = []

    class Session:  # stands in for KedroSession: what would have been trained is all we need
        @classmethod
        def create(cls, **kwargs):
            return cls()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def run(self, pipeline_names):
            runs.append(pipeline_names)

    monkeypatch.setattr("kedro.framework.session.KedroSession", Session)
    monkeypatch.setattr("kedro.framework.startup.bootstrap_project", lambda path: None)
    yield root, runs


def held_lines(n: int) -> str:
    """The first `n` ratings of MovieLens-100k: rows the raw folder already holds."""
    lines = (embedded_ml100k_folder() / "ml-100k.inter").read_text().splitlines()
    return "\n".join([HEADER, *lines[1 : n + 1]]) + "\n"


def versions() -> list[str]:
    return [
        str(mv.version)
        for mv in mlflow.MlflowClient().search_model_versions(f"name = '{registry.DIFFUSION_MODEL}'")
    ]


def test_the_same_delivery_again_trains_and_registers_nothing(
    project: tuple[Path, list], capsys: pytest.CaptureFixture[str]
) -> None:
    project, runs = project
    incoming = project / "data/01_raw/incoming"
    (incoming / "ml-100k.again.inter").write_text(held_lines(30))
    (incoming / "ml-100k.broken.inter").write_text(held_lines(3) + "7\tnot-a-row\n")
    raw_before = {p.name: p.read_bytes() for p in embedded_ml100k_folder().iterdir()}
    assert ops(["retrain"]) == 1  # a quarantined file needs a person: said on stderr, status 1
    assert runs == []
    assert capsys.readouterr().err == (
        "nothing new in data/01_raw/incoming (2 file(s): 1 quarantined, the rest already held): "
        "no retrain, diffusion-gr2 v1 stays champion\n"
    )
    assert versions() == ["1"]
    report = json.loads((project / "data/08_reporting/retrain/ingest_without_retrain.json").read_text())
    assert not (project / "data/08_reporting/retrain/ingest.json").exists()  # the last retrain's, untouched
    assert [f["status"] for f in report["files"]] == ["duplicate", "quarantined"]
    assert (incoming / "done/ml-100k.again.inter").exists()
    assert (project / "data/01_raw/quarantine/ml-100k.broken.inter").exists()
    raw = project / "data/01_raw/ml-100k"
    assert sorted(p.name for p in raw.iterdir()) == ["ml-100k.inter", "ml-100k.item"]
    assert (raw / "ml-100k.inter").read_bytes() == raw_before["ml-100k.inter"]
    assert not (project / "data/01_raw/incoming/.retrain.lock").exists()


def test_new_rows_or_force_run_the_retrain_pipeline(project: tuple[Path, list]) -> None:
    project, runs = project
    incoming = project / "data/01_raw/incoming"
    (incoming / "ml-100k.again.inter").write_text(held_lines(5))
    assert ops(["retrain", "--force"]) == 0
    assert runs == [["retrain"]]
    fresh = HEADER + "\n1\t1682\t4\t999999999\n"  # a pair MovieLens-100k does not have
    (incoming / "ml-100k.fresh.inter").write_text(fresh)
    assert ops(["retrain"]) == 0
    assert runs == [["retrain"], ["retrain"]]
    # the dry run moved nothing: the pipeline's own ingest takes the files in
    assert sorted(p.name for p in incoming.iterdir() if p.is_file()) == [
        "ml-100k.again.inter",
        "ml-100k.fresh.inter",
    ]
