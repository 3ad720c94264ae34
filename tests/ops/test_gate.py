"""The promotion gate: a sound challenger is promoted; one whose own answers are invalid (repaired by the
grammar), one below the pre-rank, one clearly worse than the champion, one timed on too few rounds and
one without an operating point are not."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pandas as pd
import pytest

from diffusion_gr2.core.base.speed import TimedRate
from diffusion_gr2.core.evaluate.policy import Policy
from diffusion_gr2.core.rank.rerank import SERVED_DIFFUSION
from diffusion_gr2.core.registry import registry
from diffusion_gr2.core.registry.gate import GateConfig, decide, newest_slice, prerank_score
from diffusion_gr2.pipelines.retrain.nodes import register_models, run_gate
from tests.ops.conftest import DECODING, World

LONG = {"max_new_tokens": 96}  # room for ten 4-token SIDs: the grammar completes every answer


def requests(world: World) -> pd.DataFrame:
    rows = world.candidates
    return pd.DataFrame(
        {
            "request_id": [f"user-{u}" for u in rows["user_id"]],
            "history": [world.raw(h) for h in rows["history"]],
            "candidates": [world.raw(c) for c in rows["candidates"]],
            "target": [world.raw([t])[0] for t in rows["target"]],
        }
    )


def register(world: World, system: str, **decoding) -> str:
    name = registry.TEACHER_MODEL if system == "ar_rl" else registry.DIFFUSION_MODEL
    config = world.config(system, **{**LONG, **decoding})
    return registry.register_reranker(name, world.models[system], world.items, world.sids, config).version


# the request log off and no shadow evaluation: these tests gate on the offline slice alone
# (the shadow evaluation on logged traffic: test_shadow.py)
SERVING = {"request_log": {"enabled": False, "folder": "unused", "max_bytes": 1 << 20, "backups": 0}}


def params(tmp_path: Path, **gate_overrides: float) -> dict:
    """`params:retrain` for these tests: how the gate measures (its bars are `policy`'s)."""
    gate = {
        "slice_share": 1.0,
        "max_requests": 50,
        "speed_requests": 1,
        "speed_rounds": 6,  # the fewest whose range covers the 95% level
        **gate_overrides,
    }
    lock = str(tmp_path / ".retrain.lock")
    return {"force": False, "lock_file": lock, "min_new_rows": 1, "gate": gate, "shadow": {"enabled": False}}


def policy(margin: float = 0.0, **bars: float) -> dict:
    """`params:policy` for these tests: both R@1 margins of the gate at `margin`, no floors (random
    tiny models: their own answers are never valid), then `bars`."""
    loose = {
        "min_unforced_rate": 0.0,
        "min_speed_ratio": 0.0,
        "gate_margin": margin,
        "prerank_margin": margin,
    }
    return Policy().as_record() | loose | bars


def registering(world: World, without_operating_point: bool = False) -> dict:
    """`retrain.register` for the world's `rl` and `ar_rl` folders (`RegisterConfig`)."""
    return {
        "model_dirs": {"diffusion": str(world.models["rl"]), "teacher": str(world.models["ar_rl"])},
        "without_operating_point": without_operating_point,
        "fallback_tau": 0.9,
        "limits": {},
    }


def test_gate_promotes_a_passing_challenger_and_refuses_a_worse_one(
    store: str, world: World, tmp_path: Path
) -> None:
    # the registry's side of the gate; random models are held to no R@1 floor here (margin 1)
    loose = policy(margin=1.0)
    first = {"diffusion": register(world, "rl"), "teacher": register(world, "ar_rl")}
    report = run_gate(first, requests(world), params(tmp_path), SERVING, loose)["gate_report"]
    assert report["decision"] == "promote" and report["champion_version"] is None  # first version
    assert registry.alias_version(registry.DIFFUSION_MODEL, registry.CHAMPION).version == first["diffusion"]
    assert registry.alias_version(registry.TEACHER_MODEL, registry.CHAMPION).version == first["teacher"]

    same = {
        "diffusion": register(world, "rl"),
        "teacher": register(world, "ar_rl"),
    }  # as good as the champion
    report = run_gate(same, requests(world), params(tmp_path), SERVING, loose)["gate_report"]
    assert report["decision"] == "promote" and report["numbers"]["recall@1_vs_champion"] == 0.0
    # the same weights answer alike: the paired interval is the point itself
    assert (
        report["numbers"]["recall@1_vs_champion.low"] == report["numbers"]["recall@1_vs_champion.high"] == 0.0
    )
    assert report["champion_version"] == first["diffusion"]
    assert registry.alias_version(registry.DIFFUSION_MODEL, registry.CHAMPION).version == same["diffusion"]

    # Timed on one round: its speed-up's range covers 0% of the stated 95%, so the speed check fails
    # whatever the floor (here 0).
    hasty = {"diffusion": register(world, "rl"), "teacher": same["teacher"]}
    report = run_gate(hasty, requests(world), params(tmp_path, speed_rounds=1), SERVING, loose)["gate_report"]
    assert report["decision"] == "refuse" and report["decided_by"] == ["speed_ratio_vs_ar_rl.low"]
    assert "too few timing rounds: 1 cover 0.0% < 95%" in report["reasons"]
    assert registry.alias_version(registry.DIFFUSION_MODEL, registry.CHAMPION).version == same["diffusion"]
    assert registry.alias_version(registry.DIFFUSION_MODEL, registry.CHALLENGER).version == hasty["diffusion"]
    tags = mlflow.MlflowClient().get_model_version(registry.DIFFUSION_MODEL, hasty["diffusion"]).tags
    assert tags["gate.decision"] == "refuse" and float(tags["gate.speed_ratio_vs_ar_rl.coverage"]) == 0.0
    assert not (tmp_path / ".retrain.lock").exists()


def test_own_answers_repaired_by_the_grammar_are_refused(store: str, world: World, tmp_path: Path) -> None:
    """Served under the grammar every answer of a random model is valid; its own answers are not."""
    versions = {"diffusion": register(world, "rl"), "teacher": register(world, "ar_rl")}
    floor = policy(margin=1.0, min_unforced_rate=0.5)
    report = run_gate(versions, requests(world), params(tmp_path), SERVING, floor)
    report = report["gate_report"]
    assert report["numbers"]["valid_rate"] == 1.0 and report["numbers"]["unforced_rate"] == 0.0
    assert report["decision"] == "refuse" and report["decided_by"] == ["unforced_rate"]
    assert registry.alias_version(registry.DIFFUSION_MODEL, registry.CHAMPION) is None
    # the teacher's own answers are no better: its own gate refuses it on the same check
    assert report["teacher_gate"]["decision"] == "refuse"
    assert report["teacher_gate"]["decided_by"] == ["unforced_rate"]
    assert registry.alias_version(registry.TEACHER_MODEL, registry.CHAMPION) is None


def side(hits: list[float], own: float = 0.9, speed: float = 200.0, rounds: int = 6) -> dict:
    return {
        "n": float(len(hits)),
        "hits": hits,
        "recall@1": sum(hits) / len(hits),
        "valid_rate": 1.0,
        "unforced_rate": own,
        "output_tokens_per_s": TimedRate([speed] * rounds),
    }


def paired_hits(n: int, both: int, only_a: int, only_b: int) -> tuple[list[float], list[float]]:
    """Hits of two systems on n requests: both hit on `both`, only a on `only_a`, only b on `only_b`."""
    a = [1.0] * both + [1.0] * only_a + [0.0] * only_b
    b = [1.0] * both + [0.0] * only_a + [1.0] * only_b
    rest = n - len(a)
    return a + [0.0] * rest, b + [0.0] * rest


N = 640  # the default slice: a sound challenger passes, one 8 points worse does not (gate_power.py)
CONFIG = GateConfig(n_boot=500, policy=Policy(gate_margin=0.05, min_unforced_rate=0.5, min_speed_ratio=1.0))


def test_a_sound_first_challenger_is_promoted_and_every_figure_is_reported() -> None:
    # at parity with the teacher (they disagree on 16% of requests, half each way), above the pre-rank
    challenger, teacher = paired_hits(N, 64, 51, 51)
    _, prerank = paired_hits(N, 64, 51, 0)
    result = decide(side(challenger), None, side(teacher, speed=100.0), prerank_score_of(prerank), CONFIG)
    assert result["decision"] == "promote"
    numbers = result["numbers"]
    assert numbers["recall@1_vs_teacher"] == 0.0 and -0.05 < numbers["recall@1_vs_teacher.low"] < 0.0
    assert numbers["recall@1_vs_prerank.low"] > 0.0 and numbers["unforced_rate"] == 0.9
    assert {c["name"] for c in result["checks"]} == {  # no served-valid check: the grammar makes it 1
        "unforced_rate",
        "recall@1_vs_prerank.low",
        "recall@1_vs_teacher.low",
        "speed_ratio_vs_ar_rl.low",
    }
    assert "hits" not in result["challenger_metrics"]  # per-request lists stay out of the report


def prerank_score_of(hits: list[float]) -> dict:
    return {"n": float(len(hits)), "hits": hits, "recall@1": sum(hits) / len(hits)}


@pytest.mark.parametrize(
    ("case", "failed"),
    [
        ("below_prerank", "recall@1_vs_prerank.low"),
        ("worse_than_champion", "recall@1_vs_champion.low"),
        ("own_answers_invalid", "unforced_rate"),
        ("slower", "speed_ratio_vs_ar_rl.low"),
        ("too_few_rounds", "speed_ratio_vs_ar_rl.low"),
    ],
)
def test_each_check_refuses_on_its_own(case: str, failed: str) -> None:
    good, fair = paired_hits(N, 64, 51, 51)  # parity
    worse, champion = paired_hits(N, 64, 25, 76)  # 8 points below
    prerank = fair
    challenger = side(good)
    if case == "below_prerank":
        challenger, prerank = side(worse), champion
    elif case == "worse_than_champion":
        challenger = side(worse)
        prerank = [0.0] * N
    elif case == "own_answers_invalid":
        challenger = side(good, own=0.1)
    elif case == "slower":
        challenger = side(good, speed=50.0)
    elif case == "too_few_rounds":  # twice as fast, but on 5 rounds: a 94% interval, short of 95%
        challenger = side(good, rounds=5)
    # the champion: 8 points above when the challenger is to fall short of it; else level with it
    champion_side = side({"worse_than_champion": champion, "below_prerank": worse}.get(case, fair))
    teacher = side(fair, speed=100.0, rounds=5 if case == "too_few_rounds" else 6)
    result = decide(challenger, champion_side, teacher, prerank_score_of(prerank), CONFIG)
    assert result["decision"] == "refuse" and result["decided_by"] == [failed]
    assert failed in result["reasons"]


def test_the_speed_check_takes_the_lower_end_of_the_paired_speed_up() -> None:
    """Faster in the median round but slower in one of six: the interval's lower end decides."""
    good, fair = paired_hits(N, 64, 51, 51)
    teacher = TimedRate([100.0] * 6)
    steady, shaky = TimedRate([150.0] * 6), TimedRate([150.0, 160.0, 90.0, 150.0, 155.0, 145.0])
    prerank = prerank_score_of([0.0] * N)
    for rate, decision in ((steady, "promote"), (shaky, "refuse")):
        challenger = side(good) | {"output_tokens_per_s": rate}
        result = decide(challenger, None, side(fair) | {"output_tokens_per_s": teacher}, prerank, CONFIG)
        numbers = result["numbers"]
        assert result["decision"] == decision and numbers["speed_ratio_vs_ar_rl"] == 1.5
        assert numbers["speed_ratio_vs_ar_rl.low"] == (1.5 if rate is steady else 0.9)
        assert numbers["speed_ratio_vs_ar_rl.coverage"] == pytest.approx(1 - 2 / 64)


def test_the_prerank_side_is_its_first_candidate() -> None:
    rows = pd.DataFrame({"candidates": [["a", "b"], ["c", "d"], ["e", "f"]], "target": ["a", "d", "e"]})
    assert prerank_score(rows)["hits"] == [1.0, 0.0, 1.0]


def test_newest_slice_dates_each_test_point_by_its_own_time() -> None:
    """With several test points per user, a user's later points are the newer requests."""
    candidates = pd.DataFrame(
        {
            "user_id": [0, 0, 1, 1],
            "split": "test",
            "point": [0, 1, 0, 1],
            "history": [[0], [0, 1], [3], [3, 4]],
            "target": [1, 2, 4, 5],
            "candidates": [[1, 2], [2, 5], [4, 5], [5, 1]],
        }
    )
    splits = pd.DataFrame({"user_id": [0, 1], "test_timestamps": [[10, 40], [20, 30]]})
    items = pd.DataFrame({"item_id": range(6), "raw_item_id": [f"i{i}" for i in range(6)]})
    rows = newest_slice(candidates, splits, items, GateConfig(slice_share=0.5))
    assert rows["request_id"].tolist() == ["user-0-point-1", "user-1-point-1"]
    assert rows["timestamp"].tolist() == [40, 30] and rows["target"].tolist() == ["i2", "i5"]


def test_the_champion_comparison_gets_a_paired_interval_over_users() -> None:
    challenger = side([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    champion = side([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    users = [0, 0, 1, 1, 2, 2, 3, 3]
    prerank = prerank_score_of([0.0] * 8)
    numbers = decide(challenger, champion, side([0.0] * 8), prerank, GateConfig(), users)["numbers"]
    assert numbers["recall@1_vs_champion"] == 0.25
    assert 0.0 <= numbers["recall@1_vs_champion.low"] < 0.25 < numbers["recall@1_vs_champion.high"] <= 0.5
    # with a champion the champion is the check; the teacher's paired figures are still reported
    assert "recall@1_vs_teacher.low" in numbers
    checked = {
        c["name"]
        for c in decide(challenger, champion, side([0.0] * 8), prerank, GateConfig(), users)["checks"]
    }
    assert "recall@1_vs_champion.low" in checked and "recall@1_vs_teacher.low" not in checked


def test_a_refused_operating_point_registers_the_teacher_and_the_prerank_not_the_diffusion_model(
    store: str, world: World, tmp_path: Path
) -> None:
    refused = "no (tau, window) reaches R@1 0.117 on validation; the best R@1 was 0.148 at tau 0.6"
    chosen = {SERVED_DIFFUSION: {"tau": None, "window": None, "refused": refused}}
    retrain = params(tmp_path) | {"register": registering(world)}
    floor = policy(min_unforced_rate=0.5)  # the random teacher's own answers fail it
    traces, inference = {"prompt": {}}, {"decoding": {**DECODING, **LONG}}
    versions = register_models(None, None, world.items, world.sids, chosen, retrain, traces, inference)
    assert versions["diffusion"] is None and refused in versions["not_registered"]
    assert versions["teacher"] == "1" and versions["prerank"] == "1"
    report = run_gate(versions, requests(world), retrain, SERVING, floor)["gate_report"]
    assert report["decision"] == "not_registered" and refused in report["reasons"]
    assert report["teacher_gate"]["decision"] == "refuse"
    names = {m.name for m in mlflow.MlflowClient().search_registered_models()}
    assert names == {registry.TEACHER_MODEL, registry.PRERANK_MODEL}
    # neither re-ranker passed: the retriever's order is the champion, and the report says so
    assert registry.alias_version(registry.PRERANK_MODEL, registry.CHAMPION).version == versions["prerank"]
    assert report["serving"].startswith(f"serving {registry.PRERANK_MODEL} v1 (the retriever's order")
    assert "diffusion-gr2 has no version" in report["serving"] and "unforced_rate" in report["serving"]
    assert not (tmp_path / ".retrain.lock").exists()
    missing = register_models(None, None, world.items, world.sids, {}, retrain, traces, inference)
    assert missing["diffusion"] is None and "no entry" in missing["not_registered"]

    override = retrain | {"register": registering(world, without_operating_point=True)}
    forced = register_models(None, None, world.items, world.sids, chosen, override, traces, inference)
    tags = mlflow.MlflowClient().get_model_version(registry.DIFFUSION_MODEL, forced["diffusion"]).tags
    source = tags["operating_point.source"]
    assert source.startswith("fallback tau 0.9 by retrain.register.without_operating_point")
    assert refused in tags["operating_point.source"]


def test_each_gate_threshold_passes_exactly_at_its_bar() -> None:
    """`unforced_rate` at the floor, the paired R@1 interval's lower end at -margin and the speed-up's
    lower end at the floor all pass; just short of each, the check fails."""
    config = GateConfig(
        n_boot=200, policy=Policy(gate_margin=0.05, min_unforced_rate=0.5, min_speed_ratio=1.0)
    )
    # identical hits: the paired interval is the point 0; the margin is set to meet it exactly
    hits = [1.0, 0.0] * 20
    at_bar = decide(
        side(hits, own=0.5, speed=100.0), None, side(hits, speed=100.0), prerank_score_of(hits), config
    )
    assert at_bar["decision"] == "promote", at_bar["reasons"]
    assert at_bar["numbers"]["speed_ratio_vs_ar_rl.low"] == 1.0
    assert at_bar["numbers"]["recall@1_vs_prerank.low"] == 0.0
    no_margin = GateConfig(
        n_boot=200,
        policy=Policy(gate_margin=0.0, prerank_margin=0.0, min_unforced_rate=0.5, min_speed_ratio=1.0),
    )
    exact = decide(
        side(hits, own=0.5, speed=100.0), None, side(hits, speed=100.0), prerank_score_of(hits), no_margin
    )
    assert exact["decision"] == "promote"  # lower end 0.0 >= -0.0
    # the float tolerance of `>=`: a figure 1e-12 short of its bar still reaches it
    edge = decide(
        side(hits, own=0.5 - 1e-12, speed=100.0),
        None,
        side(hits, speed=100.0),
        prerank_score_of(hits),
        no_margin,
    )
    assert edge["decision"] == "promote", edge["reasons"]
    short = {
        "unforced_rate": side(hits, own=0.5 - 1e-9, speed=100.0),
        "speed_ratio_vs_ar_rl.low": side(hits, own=0.5, speed=100.0 - 1e-7),
    }
    for name, challenger in short.items():
        result = decide(challenger, None, side(hits, speed=100.0), prerank_score_of(hits), no_margin)
        assert result["decided_by"] == [name], result["reasons"]
    worse = [1.0, 0.0] * 19 + [0.0, 0.0]  # one hit fewer: the lower end goes below 0
    result = decide(side(worse, own=0.5), None, side(worse), prerank_score_of(hits), no_margin)
    assert result["decided_by"] == ["recall@1_vs_prerank.low"]
