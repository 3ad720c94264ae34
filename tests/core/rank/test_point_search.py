"""The operating point's search in one core call: its typed config, and each bar of the serving policy
exactly at its bound (the R@1 margins, the own-valid floor, the timed speed floor) through the real
decode, pairing and timing."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.bench.benchmark import candidate_timer
from diffusion_gr2.core.evaluate.policy import Policy
from diffusion_gr2.core.rank.operating_point import PRERANK, paired_key, timed_speed_ratio
from diffusion_gr2.core.rank.point_search import (
    OperatingPointConfig,
    Reference,
    search_operating_point,
)
from diffusion_gr2.core.rank.rerank import RerankConfig, rerank_system, select_requests
from diffusion_gr2.parameters import load_parameters
from tests.core.model.tiny import tiny_model_for
from tests.core.rank.world import make_world

CONF = Path(__file__).resolve().parents[3] / "conf"
ENVS = [
    None,
    *sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name not in {"base", "local", "accelerate"}),
]
KEY, PRE = paired_key("ar_rl"), paired_key(PRERANK)
SECTION: dict[str, Any] = {  # every key, values of no environment
    "systems": ["rl"],
    "reference": "ar_rl",
    "n_boot": 100,
    "floor_screen": None,
    "speed_batch_size": 1,
    "taus": [0.9],
    "windows": [None],
    "timing": {"n_prompts": 2, "batch_sizes": [1], "rounds": 1, "min_calls": 1, "warmup": 0},
}

# every bar open: each test below moves one of them to the figure the search measured
LOOSE = Policy(min_unforced_rate=0.0, min_speed_ratio=0.0, choice_margin=1.0, prerank_margin=1.0)


@pytest.mark.parametrize("env", ENVS)
def test_every_environment_builds_the_config(env: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DIFFUSION_GR2_PRETRAINED", raising=False)
    params = load_parameters(env, CONF)
    section, policy = params["inference"]["operating_point"], Policy.from_params(params["policy"])
    config = OperatingPointConfig.from_params(section, policy)
    assert config.policy is policy and config.n_boot == section["n_boot"]
    assert config.candidates == [(float(t), w) for t in section["taus"] for w in section["windows"]]
    # the harness's reference is the operating point's, stated once
    assert candidate_timer(config).keywords["config"].reference == config.reference == section["reference"]
    assert config.timing.n_prompts == section["timing"]["n_prompts"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"budgett": 0.03}, r"unknown keys \['budgett'\]"),
        # a bar written here would be a second copy of the policy's
        ({"budget": 0.03}, r"unknown keys \['budget'\]"),
        ({"min_unforced_rate": 0.5}, r"unknown keys \['min_unforced_rate'\]"),
        ({"timing": SECTION["timing"] | {"taus": [0.9]}}, r"timing: unknown keys \['taus'\]"),
        ({"timing": SECTION["timing"] | {"reference": "ar_sft"}}, r"timing: unknown keys \['reference'\]"),
        ({"floor_screen": {"requests": 10}}, r"floor_screen: unknown keys \[\], missing keys \['z'\]"),
        ({"timing": None}, "ranked by the harness's timing alone"),
        ({"timing": SECTION["timing"] | {"n_prompts": 0}}, "at least one prompt"),
    ],
)
def test_the_config_refuses_unknown_missing_and_untimed(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OperatingPointConfig.from_params(SECTION | change, LOOSE)
    missing = {k: v for k, v in SECTION.items() if k != "n_boot"}
    with pytest.raises(ValueError, match=r"missing keys \['n_boot'\]"):
        OperatingPointConfig.from_params(missing, LOOSE)


class World:
    """Validation requests, an AR reference with its rows, and a diffusion model to search."""

    def __init__(self) -> None:
        self.tokenizer: PreTrainedTokenizerFast
        self.tokenizer, requests = make_world(n_users=5, splits=("valid",))
        self.valid = select_requests(requests, "valid")
        self.decoding = RerankConfig(max_new_tokens=8, batch_size=4, constrained=False, device="cpu")
        torch.manual_seed(0)
        self.ar: PreTrainedModel = tiny_model_for(self.tokenizer)
        self.diffusion: PreTrainedModel = tiny_model_for(self.tokenizer, block_size=4)
        self.ar_rows = rerank_system(
            self.ar, self.valid, self.tokenizer, "ar_rl", [], self.decoding, "valid"
        )[0]

    def search(self, config: OperatingPointConfig, reference_model: bool = True) -> dict[str, Any]:
        """The search, timed by the harness on a clock whose every call lasts the same (a rerun
        times the same speeds)."""
        ticks = itertools.count()
        timer = candidate_timer(config, clock=lambda: float(next(ticks)))
        reference = Reference(self.ar_rows, self.ar if reference_model else None)
        return search_operating_point(
            self.diffusion, self.tokenizer, "rl", self.valid, reference, self.decoding, config, timer
        ).point


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only add contention
    yield World()
    torch.set_num_threads(threads)


BASE = OperatingPointConfig.from_params(SECTION, LOOSE)


def bars(**changes: float) -> OperatingPointConfig:
    return replace(BASE, policy=replace(LOOSE, **changes))


@pytest.mark.parametrize(("key", "field"), [(KEY, "choice_margin"), (PRE, "prerank_margin")])
def test_each_r1_margin_admits_a_candidate_whose_lower_bound_is_exactly_at_it(
    world: World, key: str, field: str
) -> None:
    (candidate,) = world.search(BASE)["candidates"]
    low = candidate[f"{key}.low"]
    at = world.search(bars(**{field: -low}))
    assert at["tau"] == 0.9 and at["chosen"][f"{key}.low"] == low
    below = world.search(bars(**{field: -low - 1e-6}))
    assert below["tau"] is None and f"{key}.low {low:+.3f} < {low + 1e-6:+.3f}" in below["refused"]
    assert "timed_prompts" not in below["candidates"][0]  # refused on accuracy: never timed


def test_the_own_valid_floor_admits_a_candidate_exactly_at_it(world: World) -> None:
    (candidate,) = world.search(BASE)["candidates"]
    own = candidate["unforced_rate"]
    at = world.search(bars(min_unforced_rate=own))
    assert at["tau"] == 0.9 and at["chosen"]["unforced_rate"] == own
    above = world.search(bars(min_unforced_rate=own + 1e-9))
    assert above["tau"] is None and f"own valid rate >= {own + 1e-9:.2f}" in above["refused"]


def test_the_speed_floor_admits_a_timed_speed_up_exactly_at_it(world: World) -> None:
    (candidate,) = world.search(BASE)["candidates"]
    speed = timed_speed_ratio(candidate, "ar_rl", 1)
    assert speed is not None and speed > 0
    at = world.search(bars(min_speed_ratio=speed))
    assert at["tau"] == 0.9 and timed_speed_ratio(at["chosen"], "ar_rl", 1) == speed
    above = world.search(bars(min_speed_ratio=speed * (1 + 1e-6)))
    assert above["tau"] is None and "timed speed-up over ar_rl" in above["refused"]


def test_the_chosen_speed_is_the_harness_figure_never_the_pass_wall_clock(world: World) -> None:
    point = world.search(replace(BASE, windows=(None, 2)))
    for c in point["candidates"]:  # both admitted (budget 1): both timed beside ar_rl, in one round
        assert c["timed_prompts"] == 2 and c["statistic"].startswith("median of 1 interleaved round")
        # the steady clock makes a call last 1 s, so the harness reads at most max_new_tokens (8)
        # tokens/s; the pass's own wall clock, kept beside it, reads the real (far higher) speed
        assert c["tokens_per_s"] == pytest.approx(c["tokens_per_s_by_batch"]["1"])
        assert 0 < c["tokens_per_s"] <= 8 < c["pass_tokens_per_s"]
    fastest = max(point["candidates"], key=lambda c: (c["tokens_per_s"], c["recall@1"]))
    assert (point["tau"], point["window"]) == (fastest["tau"], fastest["window"])


def test_no_reference_model_or_rows_refuses_without_timing(world: World) -> None:
    point = world.search(BASE, reference_model=False)
    assert point["tau"] is None and "ar_rl's model was not given" in point["refused"]
    assert "timed_prompts" not in point["candidates"][0]
    reference = Reference(None, world.ar)
    untimed = candidate_timer(BASE)
    rows = search_operating_point(
        world.diffusion, world.tokenizer, "rl", world.valid, reference, world.decoding, BASE, untimed
    )
    assert "no validation rankings of the reference" in rows.point["refused"]
    assert isinstance(rows.rows, pd.DataFrame) and len(rows.rows) == len(world.valid)
