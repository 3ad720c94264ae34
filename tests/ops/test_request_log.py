"""The request log: whole rows only (a writer killed mid-write, concurrent writers), bounded by rotation,
off by a setting, written by the served pyfunc model and by the batch re-rank pipeline."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import mlflow
import pytest

from diffusion_gr2.core.registry import registry
from diffusion_gr2.core.serving.request_log import (
    LOG_NAME,
    RequestLog,
    RequestLogConfig,
    ServedModel,
    read_log,
    server_environment,
)
from tests.ops.conftest import World, rerank_folder


def config(
    folder: Path, max_bytes: int = 1 << 20, backups: int = 2, enabled: bool = True
) -> RequestLogConfig:
    return RequestLogConfig(enabled=enabled, folder=str(folder), max_bytes=max_bytes, backups=backups)


def row(writer: int, k: int) -> dict:
    # ~300 bytes: a padded explanation, as a served answer carries one
    return {"writer": writer, "k": k, "explanation": f"w{writer}-{k} " + "x" * 250}


def lines(folder: Path) -> list[bytes]:
    return [line for p in sorted(folder.glob("requests*.jsonl")) for line in p.read_bytes().splitlines()]


def test_rotation_bounds_the_log_and_keeps_the_newest_rows_in_order(tmp_path: Path) -> None:
    log = RequestLog(config(tmp_path, max_bytes=4096, backups=2))
    for k in range(100):  # ~30 kB through a log of at most 3 x 4 kB
        log.append([row(0, k)])
    files = sorted(p.name for p in tmp_path.glob("requests*.jsonl"))
    assert files == sorted([LOG_NAME, "requests.1.jsonl", "requests.2.jsonl"])
    assert all(p.stat().st_size <= 4096 for p in tmp_path.glob("requests*.jsonl"))
    frame, skipped = read_log(tmp_path)
    assert skipped == 0 and frame["k"].tolist() == list(range(100 - len(frame), 100))  # newest, oldest first
    assert 20 <= len(frame) < 100


def _write_rows(folder: str, writer: int, n: int, max_bytes: int) -> None:
    log = RequestLog(config(Path(folder), max_bytes=max_bytes, backups=1000))
    for k in range(n):
        log.append([row(writer, k)])


@pytest.mark.parametrize("max_bytes", [1 << 30, 8192])  # without rotation, and rotating every ~25 rows
def test_concurrent_writers_never_interleave_or_lose_a_row(tmp_path: Path, max_bytes: int) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_rows, args=(str(tmp_path), w, 150, max_bytes)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    rows = [json.loads(line) for line in lines(tmp_path)]  # any interleaved line would not parse
    assert sorted((r["writer"], r["k"]) for r in rows) == [(w, k) for w in range(4) for k in range(150)]
    frame, skipped = read_log(tmp_path)
    assert skipped == 0 and len(frame) == 600
    # each writer's rows in its own order across the rotated files
    assert all(frame[frame["writer"] == w]["k"].is_monotonic_increasing for w in range(4))


def _killed_mid_write(folder: str) -> None:
    """Append one row with os.write cut after half the bytes and the process killed there."""
    real = os.write

    def half_then_die(fd: int, data: bytes) -> int:
        real(fd, data[: len(data) // 2])
        os._exit(9)

    os.write = half_then_die
    RequestLog(config(Path(folder))).append([row(1, 0)])


def test_a_writer_killed_mid_write_leaves_no_half_row(tmp_path: Path) -> None:
    log = RequestLog(config(tmp_path))
    log.append([row(0, 0), row(0, 1)])
    proc = multiprocessing.get_context("fork").Process(target=_killed_mid_write, args=(str(tmp_path),))
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == 9
    assert not (tmp_path / LOG_NAME).read_bytes().endswith(b"\n")  # the torn tail is on disk ...
    frame, skipped = read_log(tmp_path)
    assert frame["k"].tolist() == [0, 1] and skipped == 1  # ... and no reader takes it for a row
    log.append([row(0, 2)])  # the next writer cuts it off before appending
    data = (tmp_path / LOG_NAME).read_bytes()
    assert data.endswith(b"\n") and [json.loads(x)["k"] for x in data.splitlines()] == [0, 1, 2]
    assert read_log(tmp_path)[1] == 0


def test_a_log_too_small_to_hold_a_row_is_refused() -> None:
    with pytest.raises(ValueError, match="max_bytes >= 1024"):
        RequestLogConfig(enabled=True, folder="x", max_bytes=10, backups=1)


def served_requests(world: World, n: int) -> list[dict]:
    return [
        {
            "request_id": f"r{i}",
            "user_id": f"u{i}",
            "history": world.raw(r.history),
            "candidates": world.raw(r.candidates),
        }
        for i, r in enumerate(world.candidates.head(n).itertuples(index=False))
    ]


def test_the_served_model_logs_every_answer_with_its_version_and_nothing_when_off(
    store: str, world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = registry.register_reranker(
        registry.DIFFUSION_MODEL, world.models["rl"], world.items, world.sids, world.config()
    )
    folder = tmp_path / "log"
    for key, value in server_environment(config(folder), ServedModel(ref.name, ref.version, ref.uri)).items():
        monkeypatch.setenv(key, value)
    model = mlflow.pyfunc.load_model(ref.uri)
    records = served_requests(world, 3)
    answers = model.predict(records)
    frame, skipped = read_log(folder)
    assert skipped == 0 and len(frame) == 3 and frame["request_id"].tolist() == ["r0", "r1", "r2"]
    first = frame.iloc[0]
    assert (first["model_name"], first["model_version"], first["source"]) == (ref.name, ref.version, "serve")
    assert first["user_id"] == "u0" and first["history"] == records[0]["history"]
    assert first["ranking"] == answers["ranking"].iloc[0] and first["tau"] == 0.9
    assert first["valid"] == answers["valid"].iloc[0] and first["unforced"] is None  # as answered
    assert first["latency_ms"] > 0 and first["time"].endswith("+00:00")
    with pytest.raises(mlflow.exceptions.MlflowException, match="empty"):
        model.predict([{**records[0], "history": []}])  # refused: nothing answered, nothing logged
    assert len(read_log(folder)[0]) == 3

    off = tmp_path / "off"
    for key, value in server_environment(config(off, enabled=False), ServedModel()).items():
        monkeypatch.setenv(key, value)
    mlflow.pyfunc.load_model(ref.uri).predict(records)
    assert not off.exists()


def test_the_rerank_pipeline_writes_the_same_log(store: str, world: World, tmp_path: Path) -> None:
    ref = registry.register_reranker(
        registry.DIFFUSION_MODEL, world.models["rl"], world.items, world.sids, world.config()
    )
    registry.promote(registry.DIFFUSION_MODEL, ref.version, "test")
    records = served_requests(world, 2)
    files = {"day1": {"requests": [records[0], {**records[1], "history": []}]}}
    log = tmp_path / "log"
    serving = {"request_log": {"enabled": True, "folder": str(log), "max_bytes": 1 << 20, "backups": 1}}
    rerank_folder(tmp_path, files, f"models:/{registry.DIFFUSION_MODEL}@champion", serving)
    frame, _ = read_log(log)
    assert frame["request_id"].tolist() == ["r0"]  # the refused request is not an answer
    assert (frame["model_version"].iloc[0], frame["source"].iloc[0]) == (ref.version, "rerank")


def test_serve_hands_the_log_settings_and_the_served_version_to_the_scoring_server(
    store: str, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    from diffusion_gr2.__main__ import ops
    from diffusion_gr2.core.serving.request_log import ENV_CONFIG, ENV_MODEL
    from tests.conftest import PROJECT_ROOT

    ref = registry.register_reranker(
        registry.DIFFUSION_MODEL, world.models["rl"], world.items, world.sids, world.config()
    )
    registry.promote(registry.DIFFUSION_MODEL, ref.version, "test")
    monkeypatch.chdir(PROJECT_ROOT)  # serve reads conf/ of the working directory
    started = {}

    def execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        started.update(argv=argv, env=env)
        raise SystemExit(0)  # stands in for the process becoming the server

    monkeypatch.setattr("diffusion_gr2.__main__.os.execve", execve)
    with pytest.raises(SystemExit):
        ops(["serve"])
    settings = json.loads(started["env"][ENV_CONFIG])
    assert settings["enabled"] is True
    assert settings["folder"] == str(PROJECT_ROOT / "data/07_model_output/request_log")
    served = json.loads(started["env"][ENV_MODEL])
    assert (served["name"], served["version"]) == (registry.DIFFUSION_MODEL, ref.version)
