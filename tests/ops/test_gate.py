"""The promotion gate: a challenger that meets the thresholds is promoted, a constructed worse one refused."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pandas as pd
import pytest

from diffusion_gr2.core.tracking import registry
from diffusion_gr2.core.tracking.gate import GateConfig, decide, newest_slice
from diffusion_gr2.pipelines.retrain.nodes import run_gate
from tests.ops.conftest import World

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


def params(tmp_path: Path) -> dict:
    gate = {
        "slice_share": 1.0,
        "max_requests": 50,
        "margin": 0.0,
        "min_valid_rate": 0.99,
        "min_speed_ratio": 0.0,
        "speed_requests": 2,
        "speed_rounds": 1,
    }
    return {"gate": gate, "lock_file": str(tmp_path / ".retrain.lock")}


def test_gate_promotes_a_passing_challenger_and_refuses_a_worse_one(
    store: str, world: World, tmp_path: Path
) -> None:
    first = {"rl": register(world, "rl"), "ar_rl": register(world, "ar_rl")}
    report = run_gate(first, requests(world), params(tmp_path))["gate_report"]
    assert report["decision"] == "promote" and report["champion_version"] is None  # first version
    assert registry.alias_version(registry.DIFFUSION_MODEL, registry.CHAMPION).version == first["rl"]
    assert registry.alias_version(registry.TEACHER_MODEL, registry.CHAMPION).version == first["ar_rl"]

    same = {"rl": register(world, "rl"), "ar_rl": register(world, "ar_rl")}  # as good as the champion
    report = run_gate(same, requests(world), params(tmp_path))["gate_report"]
    assert report["decision"] == "promote" and report["numbers"]["recall@1_vs_champion"] == 0.0
    # the same weights answer alike: the paired interval is the point itself
    assert (
        report["numbers"]["recall@1_vs_champion.low"] == report["numbers"]["recall@1_vs_champion.high"] == 0.0
    )
    assert report["champion_version"] == first["rl"]
    assert registry.alias_version(registry.DIFFUSION_MODEL, registry.CHAMPION).version == same["rl"]

    # Worse by construction: unconstrained and cut to 8 tokens, no answer can be a valid ranking.
    worse = {"rl": register(world, "rl", constrained=False, max_new_tokens=8), "ar_rl": same["ar_rl"]}
    report = run_gate(worse, requests(world), params(tmp_path))["gate_report"]
    assert report["decision"] == "refuse" and report["numbers"]["valid_rate"] == 0.0
    assert "valid_rate" in report["reasons"]
    assert registry.alias_version(registry.DIFFUSION_MODEL, registry.CHAMPION).version == same["rl"]
    assert registry.alias_version(registry.DIFFUSION_MODEL, registry.CHALLENGER).version == worse["rl"]
    tags = mlflow.MlflowClient().get_model_version(registry.DIFFUSION_MODEL, worse["rl"]).tags
    assert tags["gate.decision"] == "refuse" and float(tags["gate.valid_rate"]) == 0.0
    assert not (tmp_path / ".retrain.lock").exists()


@pytest.mark.parametrize(
    ("challenger_r1", "valid", "speed", "decision", "failed"),
    [
        (0.30, 1.0, 2.0, "promote", None),
        (0.29, 1.0, 2.0, "promote", None),  # within the margin
        (0.27, 1.0, 2.0, "refuse", "recall@1_vs_champion"),
        (0.30, 0.90, 2.0, "refuse", "valid_rate"),
        (0.30, 1.0, 0.8, "refuse", "speed_ratio_vs_ar_rl"),
    ],
)
def test_decide_applies_each_threshold(challenger_r1, valid, speed, decision, failed) -> None:
    def metrics(r1: float, tokens_per_s: float) -> dict[str, float]:
        return {
            "n": 100.0,
            "recall@1": r1,
            "valid_rate": valid,
            "unforced_rate": 0.5,
            "output_tokens_per_s": tokens_per_s,
        }

    config = GateConfig(margin=0.02, min_valid_rate=0.99, min_speed_ratio=1.0)
    result = decide(metrics(challenger_r1, 100.0 * speed), metrics(0.30, 100.0), metrics(0.31, 100.0), config)
    assert result["decision"] == decision
    if failed:
        assert failed in result["reasons"]


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
    base = {"n": 8.0, "valid_rate": 1.0, "unforced_rate": 1.0, "output_tokens_per_s": 100.0}
    challenger = {**base, "hits": [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0], "recall@1": 0.75}
    champion = {**base, "hits": [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0], "recall@1": 0.5}
    users = [0, 0, 1, 1, 2, 2, 3, 3]
    numbers = decide(challenger, champion, {**base, "recall@1": 0.5}, GateConfig(), users)["numbers"]
    assert numbers["recall@1_vs_champion"] == 0.25
    assert 0.0 <= numbers["recall@1_vs_champion.low"] < 0.25 < numbers["recall@1_vs_champion.high"] <= 0.5
    report = decide(challenger, champion, {**base, "recall@1": 0.5}, GateConfig(), users)
    assert "hits" not in report["challenger_metrics"]  # per-request lists stay out of the report
