"""Warm-start pieces the end-to-end retrain (tests/test_pipeline_retrain.py) does not reach."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from transformers import PreTrainedTokenizerFast

from diffusion_gr2.core.model.factory import load_model
from diffusion_gr2.core.rank.rerank import SERVED_DIFFUSION
from diffusion_gr2.core.registry import registry
from diffusion_gr2.pipelines.retrain import retrain_pipeline
from diffusion_gr2.pipelines.retrain.pipeline import BUDGETED_NODES
from diffusion_gr2.pipelines.retrain.warm import (
    champion_files,
    plan_warm_start,
    warm_budget,
    warm_conversion,
    warm_tokenizer,
)
from tests.conftest import PROJECT_ROOT
from tests.ops.conftest import World

PARAMS = {"enabled": True, "dir": "", "budgets": {"cft": {"max_steps": 3, "lr": 0.1}}}


def register_pair(world: World) -> tuple[str, str]:
    """A teacher version and a diffusion version tagged with it (as `register_models` does), promoted."""
    teacher = registry.register_reranker(
        registry.TEACHER_MODEL, world.models["ar_rl"], world.items, world.sids, world.config("ar_rl")
    ).version
    model = registry.register_reranker(
        registry.DIFFUSION_MODEL,
        world.models["rl"],
        world.items,
        world.sids,
        world.config("rl"),
        {"teacher_version": teacher},
    ).version
    registry.promote(registry.DIFFUSION_MODEL, model, "test")
    registry.promote(registry.TEACHER_MODEL, teacher, "test")
    return model, teacher


def plan_for(world: World, tmp_path: Path) -> dict:
    register_pair(world)
    return plan_warm_start({"warm_start": {**PARAMS, "dir": str(tmp_path / "warm")}}, {})


def test_the_plan_takes_the_teacher_the_champion_was_trained_with(
    store: str, world: World, tmp_path: Path
) -> None:
    model, teacher = register_pair(world)
    register_pair(world)  # a newer pair, then the diffusion model alone rolled back to the first
    registry.rollback(registry.DIFFUSION_MODEL, to_version=model)
    plan = plan_warm_start({"warm_start": {**PARAMS, "dir": str(tmp_path / "warm")}}, {})
    assert (
        plan["models"][SERVED_DIFFUSION]["version"] == model and plan["models"]["ar_rl"]["version"] == teacher
    )
    assert registry.alias_version(registry.TEACHER_MODEL, registry.CHAMPION).version != teacher

    untagged = registry.register_reranker(
        registry.DIFFUSION_MODEL, world.models["rl"], world.items, world.sids, world.config("rl")
    ).version
    registry.promote(registry.DIFFUSION_MODEL, untagged, "test")
    with pytest.raises(ValueError, match="has no teacher_version tag"):
        plan_warm_start({"warm_start": {**PARAMS, "dir": str(tmp_path / "warm")}}, {})


def test_the_plan_is_cold_without_a_champion_or_when_disabled(
    store: str, world: World, tmp_path: Path
) -> None:
    cold = plan_warm_start({"warm_start": {**PARAMS, "dir": str(tmp_path)}}, {})
    assert (
        cold == {"warm": False, "reason": cold["reason"]} and "no champion of diffusion-gr2" in cold["reason"]
    )
    assert not plan_warm_start({"warm_start": {**PARAMS, "enabled": False}}, {})["warm"]
    warm = plan_for(world, tmp_path)
    assert warm["warm"] and warm["budgets"] == PARAMS["budgets"]
    # the champion's folders, byte for byte, and named for the lineage walk as their producer wrote them
    from diffusion_gr2.core.lineage.lineage import DigestCache

    digests = DigestCache()
    assert digests.digest(warm["models"][SERVED_DIFFUSION]["model"]) == digests.digest(world.models["rl"])
    assert champion_files("convert_teacher", warm) == {
        f"model_{SERVED_DIFFUSION}": Path(warm["models"][SERVED_DIFFUSION]["model"])
    }
    assert champion_files("train_cft", warm) == {} and champion_files("convert_teacher", cold) == {}


def test_warm_nodes_take_the_champion_and_refuse_what_it_cannot_serve(
    store: str, world: World, tmp_path: Path
) -> None:
    plan = plan_for(world, tmp_path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(world.models["ar_rl"]))
    convert = warm_conversion(lambda *args: pytest.fail("a warm start must not convert"))
    model = convert(None, tokenizer, {"block_size": 4}, plan)
    champion = load_model(world.models["rl"])
    assert all(
        (a == b).all()
        for a, b in zip(model.state_dict().values(), champion.state_dict().values(), strict=True)
    )
    with pytest.raises(ValueError, match="has block size 4 .* asks for 8"):
        convert(None, tokenizer, {"block_size": 8}, plan)

    reuse = warm_tokenizer(lambda *args: pytest.fail("a warm start must not train a tokenizer"))
    assert reuse(None, world.sids, {}, {}, plan).get_vocab() == tokenizer.get_vocab()
    unknown = world.sids.assign(sid=["<a_999><b_0><c_0><d_0>"] * len(world.sids))
    with pytest.raises(ValueError, match=r"has no SID token \['<a_999>'\]"):
        reuse(None, unknown, {}, {}, plan)


def test_warm_budgets_replace_the_stage_settings_only_when_warm() -> None:
    seen = []
    node = warm_budget(lambda model, params: seen.append(params["train"]) or "trained", "cft", 1)
    params = {"train": {"max_steps": 450, "lr": 0.003, "seed": 0}}
    node("model", params, {"warm": True, "budgets": PARAMS["budgets"], "models": {}})
    node("model", params, {"warm": False, "reason": "cold"})
    assert seen == [{"max_steps": 3, "lr": 0.1, "seed": 0}, params["train"]]


def test_every_training_node_of_the_retrain_runs_under_a_warm_budget() -> None:
    params = {}
    for path in (PROJECT_ROOT / "conf/base").glob("parameters_*.yml"):
        params |= yaml.safe_load(path.read_text())
    trained = {
        node.name
        for node in retrain_pipeline().nodes
        if any(
            n.startswith("params:") and "train" in params.get(n.removeprefix("params:"), {})
            for n in node.inputs
        )
    }
    assert trained - {
        "build_ar_model",
        "record_trajectories",
        "record_trajectories_round2",
        "record_trajectories_round3",
        "record_teacher_answers",
    } == set(BUDGETED_NODES)  # they read a stage's settings
    assert {n.name for n in retrain_pipeline().nodes if "warm_start" in n.inputs} >= set(BUDGETED_NODES)
