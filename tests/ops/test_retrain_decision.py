"""The retrain decision (`core.monitoring.retrain_decision`), shared by the CLI and the pipeline's first node."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest

from diffusion_gr2.core.monitoring.ingest import IngestConfig
from diffusion_gr2.core.monitoring.retrain_decision import NothingToRetrain, RetrainConfig, decide_retrain
from diffusion_gr2.core.registry import registry
from diffusion_gr2.parameters import load_parameters
from tests.conftest import PROJECT_ROOT, make_project_copy, run_kedro
from tests.ops.conftest import World
from tests.ops.test_retrain_command import HEADER, held_lines, versions

FRESH = HEADER + "\n1\t1682\t4\t999999999\n"  # a pair MovieLens-100k does not have


@pytest.fixture
def project(store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A project copy as the working directory, an empty incoming folder, the test's MLflow store."""
    root = make_project_copy(tmp_path / "project")
    monkeypatch.chdir(root)
    (root / "data/01_raw/incoming").mkdir(parents=True)
    yield root


def champion(world: World) -> str:
    version = registry.register_reranker(
        registry.DIFFUSION_MODEL, world.models["rl"], world.items, world.sids, world.config("rl")
    ).version
    registry.promote(registry.DIFFUSION_MODEL, version, "test")
    return version


def test_the_retrain_settings_are_one_typed_config_that_refuses_unknown_keys() -> None:
    section = load_parameters(conf_source=PROJECT_ROOT / "conf")["retrain"]
    config = RetrainConfig.from_params(section)
    assert (config.force, config.lock_file, config.min_new_rows) == (
        section["force"],
        section["lock_file"],
        section["min_new_rows"],
    )
    with pytest.raises(ValueError, match=r"retrain: unknown keys \['min_new_row'\], missing keys \[\]"):
        RetrainConfig.from_params(section | {"min_new_row": 5})
    with pytest.raises(ValueError, match=r"retrain: unknown keys \[\], missing keys \['lock_file'\]"):
        RetrainConfig.from_params({k: v for k, v in section.items() if k != "lock_file"})


def decide(force: bool = False):
    return decide_retrain(IngestConfig(), "data/01_raw/incoming/.retrain.lock", force, mlflow.MlflowClient())


def test_new_rows_no_champion_or_force_retrain_and_move_nothing(project: Path, world: World) -> None:
    incoming = project / "data/01_raw/incoming"
    (incoming / "ml-100k.again.inter").write_text(held_lines(5))
    first = decide()
    assert first.retrain and first.reason == "no champion serves yet" and first.champion_version is None
    version = champion(world)
    assert decide(force=True).retrain and decide(force=True).forced
    (incoming / "ml-100k.fresh.inter").write_text(FRESH)
    fresh = decide()
    assert fresh.retrain and fresh.new_rows == 1 and fresh.champion_version == version
    # deciding to retrain is a dry run: the pipeline's own ingest takes the files in
    assert sorted(p.name for p in incoming.iterdir()) == ["ml-100k.again.inter", "ml-100k.fresh.inter"]
    assert not (project / "data/08_reporting/retrain/ingest_without_retrain.json").exists()


def test_a_plain_kedro_run_of_retrain_stops_after_the_decision(project: Path, world: World) -> None:
    champion(world)
    (project / "data/01_raw/incoming/ml-100k.again.inter").write_text(held_lines(30))
    with pytest.raises(NothingToRetrain, match="diffusion-gr2 v1 stays champion; nothing trained"):
        run_kedro(project, ["retrain"])
    assert versions() == ["1"]
    assert (project / "data/01_raw/incoming/done/ml-100k.again.inter").exists()
    assert (project / "data/08_reporting/retrain/ingest_without_retrain.json").exists()
    data = project / "data"
    written = {p.relative_to(data).parts[0] for p in data.rglob("*") if p.is_file()}
    assert written == {"01_raw", "08_reporting"}  # the files taken in and the report: nothing trained
    assert not (project / "data/08_reporting/retrain/ingest.json").exists()
