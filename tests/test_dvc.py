"""DVC mirrors the Kedro pipelines: `dvc repro data_prep` runs once, then finds nothing to do."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import PROJECT_ROOT, make_project_copy

BIN = Path(sys.executable).parent


def test_dvc_stages_mirror_the_kedro_pipelines() -> None:
    from diffusion_gr2.pipeline_registry import DEFAULT_STAGES

    stages = yaml.safe_load((PROJECT_ROOT / "dvc.yaml").read_text())["stages"]
    assert list(stages) == list(DEFAULT_STAGES)
    for name, stage in stages.items():
        assert stage["cmd"] == f"kedro run --pipelines {name}"


@pytest.mark.slow
def test_dvc_repro_twice_does_nothing_the_second_time(tmp_path: Path) -> None:
    project = make_project_copy(tmp_path)
    (project / "src").rmdir()
    shutil.copytree(PROJECT_ROOT / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("dvc.yaml", ".dvcignore"):
        shutil.copy(PROJECT_ROOT / name, project / name)
    shutil.copytree(PROJECT_ROOT / ".dvc", project / ".dvc", ignore=shutil.ignore_patterns("tmp", "cache"))
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1"}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{project / 'mlflow.db'}"

    def run(*args: str) -> str:
        done = subprocess.run(args, cwd=project, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout + done.stderr

    run("git", "init", "-q")
    first = run(str(BIN / "dvc"), "repro", "data_prep")
    assert "Running stage 'data_prep'" in first
    assert (project / "data/08_reporting/data_stats.json").exists() and (project / "dvc.lock").exists()
    second = run(str(BIN / "dvc"), "repro", "data_prep")
    assert "didn't change, skipping" in second and "Running stage" not in second
