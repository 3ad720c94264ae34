"""`accelerate launch -m diffusion_gr2 run` on two CPU processes (gloo), at smoke sizes.

One launch trains the smoke `teacher`, `conversion`, `cft`, `opd` and `rl` stages on two processes; a
one-process run with `grad_accum: 2` (the same global batch: each step's micro-batches are the two
processes' ones) must end with the same weights. Then a launch whose rank 1 is killed with SIGKILL in
the middle of `rl` must stop, naming that rank, and its relaunch must resume to the weights of an
uninterrupted run.
"""

from __future__ import annotations

import collections
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import safetensors.torch
import torch

from tests.conftest import prepared_project
from tests.distributed.launching import accelerate_launch, launch_env

BIN = Path(sys.executable).parent
STAGES = "teacher,conversion,cft,opd,rl"
TRAINED = ("ar_sft", "ar_rl", "cft", "opd", "rl")
# every training stage with two micro-batches per step: one process sees what two processes see
ACCUMULATE = ",".join(
    f"{s}.train.grad_accum=2"
    for s in ("teacher_midtrain", "teacher_sft", "teacher_ei", "teacher_rl", "cft", "opd", "rl")
)
LONG_RL = "rl.train.max_steps=24"  # 6 rollout batches: time to kill a rank between checkpoints
pytestmark = pytest.mark.skipif(not (BIN / "accelerate").exists(), reason="accelerate not installed")


def _env(project: Path) -> dict[str, str]:
    return launch_env(project)


def _launch_cmd(*kedro_args: str) -> list[str]:
    return accelerate_launch("--env", "smoke", *kedro_args)


def _one_process_cmd(*kedro_args: str) -> list[str]:
    return [str(BIN / "python"), "-m", "diffusion_gr2", "run", "--env", "smoke", *kedro_args]


def _run(cmd: list[str], project: Path, timeout: int = 300) -> str:
    done = subprocess.run(
        cmd, cwd=project, env=_env(project), capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout + done.stderr


def _weights(project: Path, name: str) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(project / "data" / "06_models" / name / "model.safetensors")


def _assert_same_weights(a: Path, b: Path, name: str) -> None:
    wa, wb = _weights(a, name), _weights(b, name)
    assert wa.keys() == wb.keys(), name
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")


def _runs(project: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(project / "mlflow.db") as db:
        return db.execute("select name, status from runs order by start_time").fetchall()


@pytest.fixture(scope="module")
def prepared(dag_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smoke project with data, semantic IDs, retrieval and traces done: the session's smoke run's
    outputs of those stages (layers 01-05 and the tokenizer), no model, checkpoint or report."""
    project = prepared_project(dag_run, tmp_path_factory.mktemp("prepared"))
    shutil.copytree(dag_run / "data/06_models/tokenizer", project / "data/06_models/tokenizer")
    return project


def _copy(prepared: Path, target: Path) -> Path:
    shutil.copytree(prepared, target)
    return target


@pytest.fixture(scope="module")
def launched(prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    project = _copy(prepared, tmp_path_factory.mktemp("two") / "p")
    return project, _run(_launch_cmd("--pipelines", STAGES), project)


@pytest.mark.slow
def test_two_processes_train_what_one_process_with_the_same_global_batch_trains(
    launched: tuple[Path, str], prepared: Path, tmp_path: Path
) -> None:
    two, log = launched
    one = _copy(prepared, tmp_path / "one")
    _run(_one_process_cmd("--pipelines", STAGES, "--params", ACCUMULATE), one)
    for name in TRAINED:
        _assert_same_weights(two, one, name)
    summary = (two / "data/08_reporting/training/rl.json").read_text()
    assert '"processes": 2' in summary


@pytest.mark.slow
def test_a_launch_is_one_mlflow_run_and_rank_0_writes_every_output_once(launched: tuple[Path, str]) -> None:
    project, log = launched
    runs = _runs(project)
    assert len(runs) == 1 and all(status == "FINISHED" for _, status in runs)  # the launch's
    saves = re.findall(r"^pid=(\d+) \S+ Saving data to (\S+) ", log, flags=re.M)
    assert {pid for pid, _ in saves} and len({pid for pid, _ in saves}) == 1, "saves from several processes"
    counts = collections.Counter(name for _, name in saves)
    for name in TRAINED:
        assert counts[f"model_{name}"] == 1, counts
    assert "rank 1: no node left for this rank" in log  # rank 1 took part, and stopped after rl


def _rank_process(launcher: subprocess.Popen, rank: int) -> psutil.Process | None:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "diffusion_gr2" in " ".join(child.cmdline()):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


@pytest.mark.slow
def test_a_killed_rank_stops_the_launch_and_the_relaunch_resumes_to_the_same_weights(
    launched: tuple[Path, str], tmp_path: Path
) -> None:
    base, _ = launched
    killed = _copy(base, tmp_path / "killed")
    reference = _copy(base, tmp_path / "reference")
    cmd = _launch_cmd("--pipelines", "rl", "--params", LONG_RL)
    checkpoints = killed / "data/06_models/checkpoints/rl"
    earlier = set(checkpoints.iterdir())  # the 8-step run's folder (another fingerprint)

    def new_checkpoints(step: int) -> list[Path]:
        return [p for p in checkpoints.glob(f"*/checkpoints/step-{step:06d}") if p.parents[1] not in earlier]

    with open(tmp_path / "killed.log", "w") as out:
        launcher = subprocess.Popen(cmd, cwd=killed, env=_env(killed), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not new_checkpoints(4):
            assert launcher.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
            time.sleep(0.05)
        rank1 = _rank_process(launcher, 1)
        assert rank1 is not None, "rank 1 not found"
        rank1.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        code = launcher.wait(timeout=120)
    stopped_in = time.monotonic() - killed_at
    log = (tmp_path / "killed.log").read_text()
    assert code != 0 and stopped_in < 90, (code, stopped_in)
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", log) and "SIGKILL" in log, log[-3000:]
    assert not new_checkpoints(24), "the run finished before the kill"

    relaunched = _run(cmd, killed)
    assert re.search(r"resumed from \S+step-0000(04|08|12|16|20)", relaunched)
    _run(cmd, reference)  # the same launch, never interrupted
    _assert_same_weights(killed, reference, "rl")
