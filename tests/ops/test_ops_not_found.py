"""The operations commands answer a wrong model name, version, alias or run with one line and status 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

from diffusion_gr2.__main__ import main, ops
from diffusion_gr2.core.registry import registry

NAME = registry.DIFFUSION_MODEL


@pytest.fixture
def versions(store: str) -> str:
    """Versions 1 and 2 of the served model (no files behind them: only names are looked up), 1 champion."""
    client = mlflow.MlflowClient()
    with mlflow.start_run() as run:
        pass
    client.create_registered_model(NAME)
    for _ in range(2):
        client.create_model_version(NAME, f"runs:/{run.info.run_id}/model", run_id=run.info.run_id)
    client.set_registered_model_alias(NAME, registry.CHAMPION, "1")
    return store


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["registry", "rollback", NAME, "--to", "99"],
            f"no version 99 of registered model {NAME} (versions: 1, 2)",
        ),
        (["registry", "promote", NAME, "7"], f"no version 7 of registered model {NAME} (versions: 1, 2)"),
        (["registry", "promote", "nope", "1"], "no registered model 'nope'"),
        (["registry", "rollback", "nope"], "no registered model 'nope'"),
        (["registry", "show", "nope"], "no registered model 'nope'"),
        (["lineage", "models:/nope@champion"], "no registered model 'nope'"),
        (
            ["lineage", f"models:/{NAME}@best"],
            f"no alias 'best' on registered model {NAME} (aliases: champion)",
        ),
        (["lineage", f"models:/{NAME}/99"], f"no version 99 of registered model {NAME} (versions: 1, 2)"),
        (["lineage", "0123456789abcdef"], "no run '0123456789abcdef' in the tracking store"),
    ],
)
def test_a_wrong_name_is_one_line_on_stderr_and_status_1(
    versions: str, argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ops(argv) == 1
    out, err = capsys.readouterr()
    assert err == line + "\n" and out == ""
    assert registry.alias_version(NAME, registry.CHAMPION).version == "1"  # nothing moved


URI_FORMS = "expected models:/NAME@ALIAS or models:/NAME/VERSION (VERSION a number)"


@pytest.mark.parametrize(
    ("target", "line"),
    [
        ("models:/nope", f"malformed model URI 'models:/nope': {URI_FORMS}"),
        ("models:/", f"malformed model URI 'models:/': {URI_FORMS}"),
        (f"models:/{NAME}@", f"malformed model URI 'models:/{NAME}@': {URI_FORMS}"),
        (f"models:/{NAME}/latest", f"malformed model URI 'models:/{NAME}/latest': {URI_FORMS}"),
        ("models:/a/b/1", f"malformed model URI 'models:/a/b/1': {URI_FORMS}"),
        (
            "runs:/abc/model",
            f"malformed lineage target 'runs:/abc/model': {URI_FORMS}, or an MLflow run id "
            "(letters, digits, _ and -)",
        ),
    ],
)
def test_a_malformed_lineage_target_is_one_line_on_stderr_and_status_1(
    target: str,
    line: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Refused before the store is opened (MLflow, or unpacking the URI, would raise a traceback)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    with pytest.raises(SystemExit) as done:
        main(["lineage", target])
    assert done.value.code == 1
    out, err = capsys.readouterr()
    assert err == line + "\n" and out == ""
    assert not (tmp_path / "mlflow.db").exists()  # a typo creates no store


def test_the_command_line_exits_1_without_a_traceback(versions: str) -> None:
    env = {**os.environ, "MLFLOW_TRACKING_URI": versions}
    done = subprocess.run(
        [sys.executable, "-m", "diffusion_gr2", "registry", "rollback", NAME, "--to", "99"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr == f"no version 99 of registered model {NAME} (versions: 1, 2)\n"  # no traceback
