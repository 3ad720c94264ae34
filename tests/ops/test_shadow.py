"""The loop at smoke sizes: the champion serves requests (logged), a delivery holds some of those users'
next interactions, a challenger is registered and gated, and gate.json holds the shadow evaluation with
the delayed-feedback hit rates; too little traffic or a challenger that disagrees is refused.

Each shadow check's bar, at the project's own settings (conf/base `retrain.shadow`), on a synthetic log
replayed by model-free rankers: just below it the gate refuses naming that check, exactly at it the
challenger passes; too little traffic or feedback refuses saying how many were found and needed."""

from __future__ import annotations

import json
import logging
import multiprocessing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
import pytest
import yaml

from diffusion_gr2.core.monitoring.ingest import IngestConfig, ingest
from diffusion_gr2.core.registry import registry
from diffusion_gr2.core.registry.gate import GateConfig, decide
from diffusion_gr2.core.registry.shadow import ShadowConfig, champion_requests, evaluate, next_interactions
from diffusion_gr2.core.serving.request_log import (
    RequestLogConfig,
    ServedModel,
    read_log,
    server_environment,
)
from diffusion_gr2.core.serving.serving import Limits, Ranker, Request
from diffusion_gr2.pipelines.retrain.nodes import run_gate
from tests.ops.conftest import World
from tests.ops.test_gate import params, policy, register, requests, side
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
    retrain = params(tmp_path) | {"shadow": shadow()}
    gate = run_gate(challenger, requests(world), retrain, serving(folder), policy(margin=1.0), report)[
        "gate_report"
    ]
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
    few = params(tmp_path) | {"shadow": shadow(min_requests=50)}
    refused = run_gate(
        {"diffusion": register(world, "rl"), "teacher": challenger["teacher"]},
        requests(world),
        few,
        serving(folder),
        policy(margin=1.0),
        report,
    )["gate_report"]
    assert refused["decision"] == "refuse" and refused["decided_by"] == ["shadow.requests"]
    assert "0 found, 50 needed" in refused["reasons"]  # the new champion logged nothing yet
    assert registry.alias_version(registry.DIFFUSION_MODEL, registry.CHAMPION).version == served_now


# --- each shadow check at its bar (conf/base), on a synthetic log replayed by model-free rankers ---

CONF = yaml.safe_load((Path(__file__).parents[2] / "conf/base/parameters_retrain.yml").read_text())
BARS = ShadowConfig(**CONF["retrain"]["shadow"])  # the project's bars: 50, 30, 0.2, 0.2, 0.8, 16
CHAMPION = registry.VersionRef(registry.DIFFUSION_MODEL, "1", None)
CANDIDATES = [str(i) for i in range(1, 11)]


class FakeRanker:
    """A ranker without a model (`Ranker`'s parse and answer format): each request's candidates as
    sent, or the ranking `answers` holds for its id; every call takes `latency_ms`."""

    parse = Ranker.parse

    def __init__(self, latency_ms: float = 8.0, answers: dict[str, list[str]] | None = None) -> None:
        self.limits = Limits()
        self.known = {str(i): i for i in range(1, 200)}
        self.raw_of = {i: r for r, i in self.known.items()}
        self.latency_ms, self.answers = latency_ms, answers or {}

    def rank(
        self, requests: Sequence[Request], batch_size: int | None = None, own_valid: bool = False
    ) -> list[dict[str, Any]]:
        return [
            {
                "request_id": r.request_id,
                "ranking": self.answers.get(r.request_id, [self.raw_of[c] for c in r.candidates]),
                "valid": True,
                "unforced": True,
                "latency_ms": self.latency_ms,
            }
            for r in requests
        ]


def logged(n: int, version: str = "1") -> pd.DataFrame:
    """n requests the champion answered (its ranking: the candidates as sent), as `read_log` returns them."""
    return pd.DataFrame(
        {
            "request_id": [f"r{i}" for i in range(n)],
            "user_id": [f"u{i}" for i in range(n)],
            "history": [[str(100 + i)] for i in range(n)],
            "candidates": [CANDIDATES] * n,
            "ranking": [CANDIDATES] * n,
            "valid": [True] * n,
            "latency_ms": [8.0] * n,
            "model_name": [registry.DIFFUSION_MODEL] * n,
            "model_version": [version] * n,
        }
    )


def delivered(users: int) -> pd.DataFrame:
    """The next interaction of the first `users` logged users: an item neither ranks first (no hits)."""
    return pd.DataFrame(
        {
            "raw_user_id": [f"u{i}" for i in range(users)],
            "raw_item_id": ["50"] * users,
            "timestamp": [1] * users,
        }
    )


def gated(
    challenger: FakeRanker, log: pd.DataFrame, feedback: pd.DataFrame, champion: FakeRanker | None = None
) -> dict[str, Any]:
    """The gate's report with the shadow evaluation as `run_gate` builds it; the offline checks pass."""
    gate = GateConfig()
    replay = evaluate(challenger, CHAMPION, lambda uri: champion or FakeRanker(), log, feedback, gate, BARS)
    hits = [1.0, 0.0] * 10
    return decide(side(hits), side(hits), side(hits, speed=100.0), side(hits), gate, shadow=replay)


def swapped(n: int) -> dict[str, list[str]]:
    """The first n requests answered with the served first two items swapped: another top-1, the same
    rest (Kendall tau 1 - 2/45 to the served ranking)."""
    return {f"r{i}": [CANDIDATES[1], CANDIDATES[0], *CANDIDATES[2:]] for i in range(n)}


def test_the_project_bars_are_the_ones_tested() -> None:
    assert (BARS.min_requests, BARS.min_feedback) == (50, 30)
    assert (BARS.min_top1_agreement, BARS.min_speedup, BARS.latency_requests) == (0.2, 0.8, 16)


def test_top1_agreement_below_the_bar_is_refused_and_exactly_at_it_passes() -> None:
    log, feedback = logged(50), delivered(50)
    # 10 of 50 with the served top-1: 0.2, the bar itself (>=, not >)
    at = gated(FakeRanker(answers=swapped(40)), log, feedback)
    assert at["numbers"]["shadow.top1_agreement"] == 0.2
    assert at["numbers"]["shadow.rank_correlation"] > 0.9  # only the top-1 differs
    assert at["decision"] == "promote", at["reasons"]
    # 9 of 50: 0.18, refused on that check alone, named with its figure and bar
    below = gated(FakeRanker(answers=swapped(41)), log, feedback)
    assert below["decision"] == "refuse" and below["decided_by"] == ["shadow.top1_agreement"]
    assert below["reasons"].startswith("shadow.top1_agreement = 0.1800 < 0.2000 (same top-1 as the served")


def test_rank_correlation_below_the_bar_is_refused_and_exactly_at_it_passes() -> None:
    log, feedback = logged(50), delivered(50)
    reverse = {f"r{i}": CANDIDATES[::-1] for i in range(50)}  # tau -1; the rest answered as served (+1)
    # 30 as served, 20 reversed: mean tau (30 - 20) / 50 = 0.2, the bar
    at = gated(FakeRanker(answers={k: v for k, v in reverse.items() if int(k[1:]) >= 30}), log, feedback)
    assert at["numbers"]["shadow.rank_correlation"] == pytest.approx(0.2, abs=1e-15)
    assert at["decision"] == "promote", at["reasons"]
    below = gated(FakeRanker(answers={k: v for k, v in reverse.items() if int(k[1:]) >= 29}), log, feedback)
    assert below["decision"] == "refuse" and below["decided_by"] == ["shadow.rank_correlation"]
    assert "shadow.rank_correlation = 0.1600 < 0.2000" in below["reasons"]


def test_a_challenger_slower_than_the_speed_floor_is_refused_and_one_exactly_at_it_passes() -> None:
    log, feedback = logged(50), delivered(50)
    champion = FakeRanker(latency_ms=8.0)
    # 10 ms against the champion's 8 at batch 1: a speed-up of 0.8 on every request, the floor
    at = gated(FakeRanker(latency_ms=10.0), log, feedback, champion)
    assert at["numbers"]["shadow.speedup_vs_champion.low"] == 0.8
    assert at["numbers"]["shadow.latency_ms.p50"] == 10.0
    assert at["numbers"]["shadow.champion.latency_ms.p50"] == 8.0
    assert at["decision"] == "promote", at["reasons"]
    # 10.5 ms: 0.762, refused on the speed check alone
    slow = gated(FakeRanker(latency_ms=10.5), log, feedback, champion)
    assert slow["decision"] == "refuse" and slow["decided_by"] == ["shadow.speedup_vs_champion.low"]
    assert (
        "shadow.speedup_vs_champion.low = 0.7619 < 0.8000 (median per-request speed-up 0.76x"
        in (slow["reasons"])
    )


def test_too_few_logged_requests_refuse_saying_how_many_were_found_and_needed() -> None:
    challenger = FakeRanker()
    # 49 logged (50 needed): one check says so, with the feedback count, and what to do; nothing is judged
    few = gated(challenger, logged(49), delivered(49))
    assert few["decision"] == "refuse" and few["decided_by"] == ["shadow.requests"]
    assert [c["name"] for c in few["checks"] if c["name"].startswith("shadow.")] == ["shadow.requests"]
    assert (
        "too few logged requests of the serving champion diffusion-gr2 v1: 49 found, 50 needed;"
        in (few["reasons"])
    )
    assert "make serve" in few["reasons"] and "retrain.shadow.enabled=false" in few["reasons"]
    assert few["numbers"]["shadow.feedback_requests"] == 49.0
    # 50 logged, one with a candidate the catalogue lacks: 49 replayable, said so
    log = logged(50)
    log.at[0, "candidates"] = [*CANDIDATES[:-1], "999"]
    left_out = gated(challenger, log, delivered(50))
    assert left_out["decided_by"] == ["shadow.requests"]
    assert "49 found, 50 needed (1 of the 50 logged left out" in left_out["reasons"]
    # the champion's version only: another version's traffic does not count
    other = gated(challenger, pd.concat([logged(49), logged(10, version="7")]), delivered(49))
    assert "49 found, 50 needed;" in other["reasons"]
    # exactly 50: judged
    assert gated(challenger, logged(50), delivered(50))["decision"] == "promote"


def test_too_few_requests_with_feedback_refuse_saying_how_many_were_found_and_needed() -> None:
    challenger, log = FakeRanker(), logged(50)
    # 29 of the 50 users' next interactions delivered (30 needed): the hit rate is not judged, the rest is
    few = gated(challenger, log, delivered(29))
    assert few["decision"] == "refuse" and few["decided_by"] == ["shadow.feedback_requests"]
    assert "shadow.hit_rate_vs_champion.low" not in {c["name"] for c in few["checks"]}
    assert {"shadow.top1_agreement", "shadow.speedup_vs_champion.low"} <= {c["name"] for c in few["checks"]}
    assert (
        "too few logged requests with a delivered next interaction (29 delivered rows): 29 found, 30 needed"
        in (few["reasons"])
    )
    # exactly 30: the realised hit rates are compared (both 0 here) and the challenger passes
    at = gated(challenger, log, delivered(30))
    assert at["decision"] == "promote", at["reasons"]
    assert at["numbers"]["shadow.feedback_requests"] == 30.0 and at["numbers"]["shadow.hit_rate"] == 0.0
    # no delivery at all (a `make register`): 0 found
    none = gated(challenger, log, delivered(0))
    assert none["decided_by"] == ["shadow.feedback_requests"] and "0 found, 30 needed" in none["reasons"]


def test_make_register_without_served_traffic_refuses_in_one_line_and_the_champion_keeps_serving(
    store: str, world: World, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A second `make register` (the project's shadow settings, the request log on, nothing served):
    one line names the missing traffic and what to do; the first version keeps serving."""
    conf = params(tmp_path) | {"shadow": CONF["retrain"]["shadow"]}
    loose = policy(margin=1.0)
    log_on = serving(tmp_path / "request_log")  # never written: no `make serve` in between
    first = {"diffusion": register(world, "rl"), "teacher": register(world, "ar_rl")}
    assert run_gate(first, requests(world), conf, log_on, loose)["gate_report"]["decision"] == "promote"
    second = {"diffusion": register(world, "rl"), "teacher": register(world, "ar_rl")}
    with caplog.at_level(logging.INFO, logger="diffusion_gr2"):
        report = run_gate(second, requests(world), conf, log_on, loose)["gate_report"]
    assert report["decision"] == "refuse" and report["decided_by"] == ["shadow.requests"]
    refusals = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("diffusion_gr2")
    ]
    assert refusals == [
        f"gate refused diffusion-gr2 v{second['diffusion']}: shadow.requests = 0.0000 < 50.0000 (too few "
        f"logged requests of the serving champion diffusion-gr2 v{first['diffusion']}: 0 found, 50 needed, "
        "and 0 with a delivered next interaction, 30 needed (this gate had no delivery); not judged: serve "
        "traffic with `make serve` (serving.request_log on), then retrain on a delivery holding those "
        "users' next interactions (`make retrain`), or set retrain.shadow.enabled=false to gate on the "
        "offline slice alone)"
    ]
    assert registry.alias_version(registry.DIFFUSION_MODEL, registry.CHAMPION).version == first["diffusion"]
    assert report["serving"].startswith(f"serving diffusion-gr2 v{first['diffusion']} ")
