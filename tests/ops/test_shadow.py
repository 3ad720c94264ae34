"""The loop at smoke sizes: the champion serves requests (logged), a delivery holds some of those users'
next interactions, a challenger is registered and gated, and gate.json holds the shadow evaluation with
the delayed-feedback hit rates; too little traffic or a challenger that disagrees is refused."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import mlflow
import pandas as pd
import pytest

from diffusion_gr2.core.tracking import registry
from diffusion_gr2.core.tracking.ingest import IngestConfig, ingest
from diffusion_gr2.core.tracking.request_log import (
    RequestLogConfig,
    ServedModel,
    read_log,
    server_environment,
)
from diffusion_gr2.core.tracking.shadow import champion_requests, next_interactions
from diffusion_gr2.pipelines.retrain.nodes import run_gate
from tests.ops.conftest import World
from tests.ops.test_gate import params, register, requests
from tests.ops.test_request_log import _killed_mid_write

HEADER = "user_id:token\titem_id:token\trating:float\ttimestamp:float"


def test_the_next_interaction_is_the_users_earliest_delivered_item_not_in_the_history() -> None:
    logged = pd.DataFrame({"user_id": ["a", "b", None, "c"], "history": [["1", "2"], ["5"], ["1"], ["1"]]})
    delivered = pd.DataFrame(
        {
            "raw_user_id": ["a", "a", "a", "b", "z"],
            "raw_item_id": ["9", "2", "7", "6", "1"],
            "timestamp": [30, 10, 20, 5, 1],
        }
    )
    # a: item 2 (t=10) is in the history, so 7 (t=20); b: 6; no user id; c: nothing delivered
    assert next_interactions(logged, delivered) == ["7", "6", None, None]


def test_only_the_champions_own_rows_are_replayed_newest_last() -> None:
    log = pd.DataFrame(
        {"model_name": ["m", "m", "other", "m"], "model_version": ["1", "2", "2", "2"], "k": [0, 1, 2, 3]}
    )
    rows = champion_requests(log, registry.VersionRef("m", "2", None), n=5)
    assert rows["k"].tolist() == [1, 3]
    assert champion_requests(log, registry.VersionRef("m", "2", None), n=1)["k"].tolist() == [3]


def serving(folder: Path) -> dict:
    return {"request_log": {"enabled": True, "folder": str(folder), "max_bytes": 1 << 20, "backups": 2}}


def shadow(**overrides: float) -> dict:
    settings = {
        "enabled": True,
        "last_requests": 100,
        "min_requests": 6,
        "min_feedback": 4,
        "min_top1_agreement": 0.5,
        "min_rank_correlation": 0.5,
        "min_speedup": 0.0,
        "latency_requests": 6,  # six per-request ratios: their range is a 97% interval
    }
    return settings | overrides


def serve_logged(
    world: World, champion: registry.VersionRef, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> list[dict]:
    """The champion answers one request per test user (raw ids, with the user id), logged as served."""
    config = RequestLogConfig(enabled=True, folder=str(folder), max_bytes=1 << 20, backups=2)
    for key, value in server_environment(config, ServedModel(champion.name, champion.version)).items():
        monkeypatch.setenv(key, value)
    model = mlflow.pyfunc.load_model(champion.uri)
    frame = requests(world)
    records = [
        {
            "request_id": r.request_id,
            "user_id": r.request_id,
            "history": r.history,
            "candidates": r.candidates,
        }
        for r in frame.itertuples(index=False)
    ]
    model.predict(records)  # one call: the replay decodes them together too (the same batch)
    return records


def deliver(world: World, answers: pd.DataFrame, root: Path) -> dict:
    """A raw folder holding the users' histories, then a delivery with the next interaction of all
    users but one: for the first three the item the champion served first, for the others another
    candidate."""
    raw = root / "raw/toy"
    raw.mkdir(parents=True)
    rows = [f"{r.user_id}\t{h}\t4\t{1000 + i}" for r in answers.itertuples() for i, h in enumerate(r.history)]
    (raw / "toy.inter").write_text("\n".join([HEADER, *rows]) + "\n")
    incoming = root / "incoming"
    incoming.mkdir()
    fresh = [
        f"{r.user_id}\t{r.ranking[0] if k < 3 else r.ranking[-1]}\t5\t{5000 + k}"
        for k, r in enumerate(answers.head(len(answers) - 1).itertuples())
    ]
    (incoming / "toy.week2.inter").write_text("\n".join([HEADER, *fresh]) + "\n")
    config = IngestConfig(
        incoming_dir=str(incoming), quarantine_dir=str(root / "q"), raw_root=str(root / "raw"), dataset="toy"
    )
    return ingest(config)


def test_serve_log_deliver_then_the_gate_replays_the_log_with_delayed_feedback(
    store: str, world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the champion, as a first registration leaves it
    first = {"diffusion": register(world, "rl"), "teacher": register(world, "ar_rl")}
    for name, version in (
        (registry.DIFFUSION_MODEL, first["diffusion"]),
        (registry.TEACHER_MODEL, first["teacher"]),
    ):
        registry.promote(name, version, "test")
    champion = registry.alias_version(registry.DIFFUSION_MODEL, registry.CHAMPION)
    folder = tmp_path / "request_log"
    serve_logged(world, champion, folder, monkeypatch)

    # serve: every answer logged whole, also across a writer killed mid-write
    proc = multiprocessing.get_context("fork").Process(target=_killed_mid_write, args=(str(folder),))
    proc.start()
    proc.join(timeout=60)
    log, torn = read_log(folder)
    assert torn == 1 and len(log) == 6 and log["model_version"].eq(champion.version).all()
    assert log["user_id"].tolist() == requests(world)["request_id"].tolist()

    # deliver: five of the six users' next interactions
    report = deliver(world, log, tmp_path / "data")
    assert report["new_rows"] == 5

    # retrain (here: a new version of the same weights) and gate it with the shadow evaluation
    challenger = {"diffusion": register(world, "rl"), "teacher": register(world, "ar_rl")}
    retrain = params(tmp_path, margin=1.0) | {"shadow": shadow()}
    gate = run_gate(challenger, requests(world), retrain, serving(folder), report)["gate_report"]
    numbers, replay = gate["numbers"], gate["shadow"]
    assert replay["requests"] == 6 and replay["torn_rows_skipped"] == 1 and replay["delivered_rows"] == 5
    assert numbers["shadow.feedback_requests"] == 5.0
    # the same weights re-rank as served: full agreement, the same realised hits
    assert numbers["shadow.top1_agreement"] == 1.0 and numbers["shadow.rank_correlation"] == pytest.approx(
        1.0
    )
    assert numbers["shadow.champion.hit_rate"] == pytest.approx(3 / 5)  # the served top-1 for three
    assert numbers["shadow.hit_rate"] == numbers["shadow.champion.hit_rate"]
    assert numbers["shadow.hit_rate_vs_champion.low"] == numbers["shadow.hit_rate_vs_champion.high"] == 0.0
    names = {c["name"]: c for c in gate["checks"]}
    assert {
        "shadow.top1_agreement",
        "shadow.rank_correlation",
        "shadow.unforced_rate",
        "shadow.speedup_vs_champion.low",
        "shadow.hit_rate_vs_champion.low",
    } <= set(names)
    assert gate["decision"] == "promote", gate["reasons"]
    on_disk = json.loads(json.dumps(gate))  # what gate.json holds
    assert on_disk["shadow"]["numbers"]["shadow.champion.hit_rate"] == pytest.approx(0.6)

    # too little traffic: every shadow check fails and says so; the champion stays
    served_now = registry.alias_version(registry.DIFFUSION_MODEL, registry.CHAMPION).version
    few = params(tmp_path, margin=1.0) | {"shadow": shadow(min_requests=50)}
    refused = run_gate(
        {"diffusion": register(world, "rl"), "teacher": challenger["teacher"]},
        requests(world),
        few,
        serving(folder),
        report,
    )["gate_report"]
    assert refused["decision"] == "refuse"
    assert all(n.startswith("shadow.") for n in refused["decided_by"]) and len(refused["decided_by"]) == 5
    assert "too few logged requests: 0 < 50" in refused["reasons"]  # the new champion logged nothing yet
    assert registry.alias_version(registry.DIFFUSION_MODEL, registry.CHAMPION).version == served_now
