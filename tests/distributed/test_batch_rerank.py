"""Decoding on every process of a launch, on two CPU processes (gloo).

* `kedro run --pipelines rerank` under `accelerate launch --num_processes 2`, killed with SIGKILL
  mid-batch and run again: the answers (and the refusals of malformed requests) equal a one-process
  run's row for row, and no served request is logged twice.
* an inference node (`rerank_ar_rl`, then `rerank_rl` choosing its operating point) under `torchrun`:
  the rankings equal a one-process run's, each process having decoded its share.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import torch

from diffusion_gr2.core.registry import registry
from diffusion_gr2.core.serving.request_log import read_log
from diffusion_gr2.datasets import AnswerChunksDataset, RequestFilesDataset
from diffusion_gr2.pipelines.rerank.nodes import answer_requests
from tests.conftest import PROJECT_ROOT, make_project_copy
from tests.distributed.launching import accelerate_launch, launch_env
from tests.ops.conftest import World, build_world, champion_in

BIN = Path(sys.executable).parent
CHUNK = 4
OUTPUT = Path("data/07_model_output/reranked")
LOG = Path("data/07_model_output/request_log")
pytestmark = pytest.mark.skipif(not (BIN / "accelerate").exists(), reason="accelerate not installed")


def _requests(world: World, n: int) -> list[dict]:
    rows = world.candidates.iloc[[i % len(world.candidates) for i in range(n)]]
    return [
        {
            "history": world.raw(r.history)[: 2 + i % 4],
            "candidates": world.raw(r.candidates),
            "request_id": f"q{i}",
        }
        for i, r in enumerate(rows.itertuples(index=False))
    ]


def _write_requests(world: World, folder: Path) -> None:
    """46 requests in three formats, five of them malformed (one not an object, one a broken line)."""
    folder.mkdir(parents=True, exist_ok=True)
    requests = _requests(world, 44)
    requests[3] = {**requests[3], "history": []}
    requests[9] = {**requests[9], "candidates": requests[9]["candidates"][:1]}
    requests[20] = {**requests[20], "candidates": ["no-such-item", *requests[20]["candidates"][1:]]}
    (folder / "a.json").write_text(json.dumps(requests[:30] + ["not an object"]))
    lines = [json.dumps(r) for r in requests[30:38]]
    (folder / "b.jsonl").write_text("\n".join(lines[:4] + ["{broken"] + lines[4:]) + "\n")
    pd.DataFrame(requests[38:]).to_parquet(folder / "c.parquet")


def _env(project: Path) -> dict[str, str]:
    return launch_env(project, collective_timeout_s=120)


def _launch_cmd() -> list[str]:
    return accelerate_launch("--pipelines", "rerank", "--params", f"rerank.chunk_size={CHUNK}")


def _answers(project: Path) -> pd.DataFrame:
    return pd.read_parquet(project / OUTPUT).drop(columns="latency_ms")  # a measurement, not an answer


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project whose registry holds a champion (a tiny `rl` model) and whose request folder holds
    46 requests; nothing answered yet."""
    world = build_world(tmp_path_factory.mktemp("world"))
    root = make_project_copy(tmp_path_factory.mktemp("batch") / "project")
    with champion_in(world, f"sqlite:///{root / 'mlflow.db'}", "batch"):
        pass
    _write_requests(world, root / "data/05_model_input/rerank_requests")
    return root


@pytest.fixture(scope="module")
def one_process(project: Path, tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    """The pipeline's answering node in this process, one thread (as each launched process has)."""
    out = tmp_path_factory.mktemp("one") / "reranked"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project / 'mlflow.db'}")
            mlflow.set_tracking_uri(f"sqlite:///{project / 'mlflow.db'}")
            mlflow.set_registry_uri(f"sqlite:///{project / 'mlflow.db'}")
            files = RequestFilesDataset(str(project / "data/05_model_input/rerank_requests")).load()
            params = {"model_uri": f"models:/{registry.DIFFUSION_MODEL}@champion", "chunk_size": CHUNK}
            off = {"request_log": {"enabled": False, "folder": "-", "max_bytes": 1 << 20, "backups": 0}}
            AnswerChunksDataset(str(out)).save(answer_requests(files, params, off))
    finally:
        torch.set_num_threads(threads)
    return pd.read_parquet(out).drop(columns="latency_ms")


def _run(cmd: list[str], project: Path) -> None:
    done = subprocess.run(cmd, cwd=project, env=_env(project), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"


def _kill_mid_batch(project: Path) -> list[str]:
    """Launch the batch on two processes and SIGKILL the whole launch once its second chunk is
    written; the chunks written by then."""
    proc = subprocess.Popen(
        _launch_cmd(), cwd=project, env=_env(project), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    parts = project / OUTPUT
    try:
        deadline = time.monotonic() + 300
        while not (parts / "part-000001.parquet").exists():
            assert proc.poll() is None, "the launch ended before its second chunk was written"
            assert time.monotonic() < deadline, "no second chunk in 300 s"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not json.loads((parts / "_job.json").read_text())["complete"]
    return sorted(p.name for p in parts.glob("part-*.parquet"))


@pytest.mark.slow
def test_two_processes_killed_mid_batch_resume_to_what_one_process_answers_and_refuses(
    project: Path, one_process: pd.DataFrame
) -> None:
    """Two launches of two processes: the first killed with SIGKILL mid-batch, the second resuming
    it. Their answers and refusals equal a one-process run's, row for row."""
    written = _kill_mid_batch(project)
    assert 2 <= len(written) < 12, written  # stopped mid-batch (12 chunks of 4)
    _run(_launch_cmd(), project)
    two = _answers(project)
    pd.testing.assert_frame_equal(two, one_process)
    refused = two[~two["ok"]]
    assert len(two) == 46 and len(refused) == 5, refused
    assert refused["error"].str.contains("not an object|line 5: not JSON|empty|at least|unknown").all()
    report = json.loads((project / "data/08_reporting/rerank_report.json").read_text())
    assert (report["requests"], report["served"], report["refused"], report["files"]) == (46, 41, 5, 3)
    # rank 0 alone logs, after each chunk is written: no answer twice (a kill between the two
    # leaves at most that chunk's answers out)
    logged, torn = read_log(project / LOG)
    ids = logged["request_id"].tolist()
    served = set(two.loc[two["ok"], "request_id"])
    assert torn == 0 and len(ids) == len(set(ids)) and set(ids) <= served and len(served - set(ids)) <= CHUNK


@pytest.mark.slow
def test_an_inference_node_decodes_on_every_process_what_one_process_decodes(tmp_path: Path) -> None:
    path = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}  # the worker module is in tests/
    one, two = tmp_path / "one", tmp_path / "two"
    for out, launcher in ((one, [str(BIN / "python")]), (two, [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2"])):  # fmt: skip
        out.mkdir()
        cmd = [*launcher, "-m", "tests.distributed.inference_worker", str(out)]
        done = subprocess.run(cmd, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    pd.testing.assert_frame_equal(
        pd.read_parquet(two / "rankings.parquet"), pd.read_parquet(one / "rankings.parquet")
    )
    alone = int((one / "decoded-0.txt").read_text())
    shares = [int((two / f"decoded-{rank}.txt").read_text()) for rank in (0, 1)]
    assert sum(shares) == alone and min(shares) > 0, (alone, shares)  # each decoded its share, once
