"""A real `mlflow models serve` process on the champion: a good request, every malformed one, rollback.

One store and one server for the module (creating a sqlite store and starting a server each take a
while on two cores); the server is started on a free port of 127.0.0.1 and stopped by the fixture.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest

from diffusion_gr2.core.registry import registry
from diffusion_gr2.core.serving.request_log import (
    RequestLogConfig,
    ServedModel,
    read_log,
    server_environment,
)
from tests.conftest import empty_mlflow_store
from tests.ops.conftest import World, champion_in, rerank_folder

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def champion(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A store with version 1 (rl) promoted to champion: (store uri, version)."""
    uri = empty_mlflow_store(tmp_path_factory.mktemp("store") / "mlflow.db")
    with champion_in(world, uri, "ops-serving") as version:
        yield uri, version


@pytest.fixture(scope="module")
def request_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder the server's request log is written to."""
    return tmp_path_factory.mktemp("request_log")


@pytest.fixture(scope="module")
def server(
    champion: tuple[str, str], request_log: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    uri, version = champion
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # the request log on, as `python -m diffusion_gr2 serve` turns it on
    settings = RequestLogConfig(enabled=True, folder=str(request_log), max_bytes=1 << 20, backups=1)
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": uri,
        "OMP_NUM_THREADS": "1",
        "PATH": f"{BIN}:{os.environ['PATH']}",
        **server_environment(settings, ServedModel(registry.DIFFUSION_MODEL, version)),
    }
    cmd = [str(BIN / "mlflow"), "models", "serve", "-m", f"models:/{registry.DIFFUSION_MODEL}@champion"]
    cmd += ["--env-manager", "local", "-h", "127.0.0.1", "-p", str(port), "-w", "1"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/ping", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                time.sleep(2)
        else:
            pytest.fail("the server did not answer /ping in time:\n" + log.read_text()[-3000:])
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def post(base: str, body: bytes | dict) -> tuple[int, dict | str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{base}/invocations", data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_the_served_champion_answers_and_refuses_malformed_requests_with_a_4xx(
    server: str, world: World, request_log: Path, champion: tuple[str, str]
) -> None:
    row = world.candidates.iloc[0]
    good = {"history": world.raw(row.history), "candidates": world.raw(row.candidates), "request_id": "r1"}
    status, reply = post(server, {"dataframe_records": [good]})
    assert status == 200, reply
    (answer,) = reply["predictions"]
    assert sorted(answer["ranking"]) == sorted(good["candidates"])  # a permutation of the candidates
    assert answer["request_id"] == "r1" and answer["tau"] == 0.9 and answer["latency_ms"] > 0
    assert {"explanation", "valid", "unforced", "reason", "nfe"} <= set(answer)
    cands = good["candidates"]
    bad = {
        "missing field": ({"dataframe_records": [{"history": good["history"]}]}, "candidates"),
        "wrong type": ({"dataframe_records": [{**good, "history": "50 172"}]}, "history"),
        "number ids": ({"dataframe_records": [{**good, "candidates": [1, 2, 3]}]}, "candidates"),
        "duplicate candidate": (
            {"dataframe_records": [{**good, "candidates": [cands[0], *cands[:-1]]}]},
            "more than once",
        ),
        "unknown candidate": (
            {"dataframe_records": [{**good, "candidates": [*cands[:-1], "no-such-item"]}]},
            "unknown",
        ),
        "empty history": ({"dataframe_records": [{**good, "history": []}]}, "empty"),
        "candidate in the history": (  # the leak training refuses (`no_candidate_in_history`)
            {"dataframe_records": [good, {**good, "candidates": [*cands[:-1], good["history"][-1]]}]},
            f"request 1: candidate(s) ['{good['history'][-1]}'] already in the history",
        ),
        "too many requests": ({"dataframe_records": [good] * 33}, "limit"),
        "oversized history": ({"dataframe_records": [{**good, "history": good["history"] * 100}]}, "limit"),
        "not json": (b"{history: [", "JSON"),
        "no records": ({"history": good["history"]}, "input fields"),
    }
    for name, (body, reason) in bad.items():
        status, text = post(server, body)
        assert 400 <= status < 500, (name, status, text)
        assert reason in str(text), (name, text)
    # with the request log on: the one answered request, whole, with the version that answered it
    logged, torn = read_log(request_log)
    assert torn == 0 and logged["request_id"].tolist() == ["r1"]
    assert logged["ranking"].iloc[0] == answer["ranking"] and logged["model_version"].iloc[0] == champion[1]


def test_the_rerank_pipeline_serves_request_files_and_names_each_refusal(
    champion: tuple[str, str], world: World, tmp_path: Path
) -> None:
    row = world.candidates.iloc[1]
    good = {"history": world.raw(row.history), "candidates": world.raw(row.candidates), "request_id": "ok"}
    files = {
        "day1": {
            "requests": [good, {**good, "request_id": "dup", "candidates": [good["candidates"][0]] * 3}]
        },
        "day2": [{**good, "request_id": "no-history", "history": []}],
    }
    off = {"request_log": {"enabled": False, "folder": "unused", "max_bytes": 1 << 20, "backups": 0}}
    answers, report = rerank_folder(tmp_path, files, f"models:/{registry.DIFFUSION_MODEL}@champion", off)
    frame = answers.set_index("request_id")
    assert bool(frame.loc["ok", "ok"]) and sorted(frame.loc["ok", "ranking"]) == sorted(good["candidates"])
    assert "more than once" in frame.loc["dup", "error"] and "empty" in frame.loc["no-history", "error"]
    assert report["served"] == 1 and report["refused"] == 2 and report["files"] == 2


def test_rolling_back_the_alias_serves_the_previous_version(champion: tuple[str, str], world: World) -> None:
    _, first = champion
    second = registry.register_reranker(
        registry.DIFFUSION_MODEL, world.models["ar_rl"], world.items, world.sids, world.config("ar_rl")
    )
    registry.promote(registry.DIFFUSION_MODEL, second.version, "test promotion")
    served = mlflow.pyfunc.load_model(f"models:/{registry.DIFFUSION_MODEL}@champion")
    assert served.unwrap_python_model().ranker.config.system == "ar_rl"
    back = registry.rollback(registry.DIFFUSION_MODEL, reason="test rollback")
    assert back.version == first
    assert registry.alias_version(registry.DIFFUSION_MODEL, registry.CHALLENGER).version == second.version
    served = mlflow.pyfunc.load_model(f"models:/{registry.DIFFUSION_MODEL}@champion")
    assert served.unwrap_python_model().ranker.config.system == "rl"
    tags = mlflow.MlflowClient().get_model_version(registry.DIFFUSION_MODEL, first).tags
    assert tags["rolled_back_from"] == second.version and tags["operating_point.tau"] == "0.9"
