"""inference nodes: the tau sweep decodes the first `sweep_max_requests` test requests, the rest all;
on validation the systems of `valid_sweep` (which choose nothing) decode the first
`sweep_max_requests` too, the other systems that choose nothing none."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pandas as pd
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from diffusion_gr2.core.evaluate.rankings import stage_metrics
from diffusion_gr2.core.rank.rerank import select_requests
from diffusion_gr2.pipelines.inference.nodes import make_rerank_node, rerank_analyst, rerank_prerank
from diffusion_gr2.pipelines.inference.pipeline import create_pipeline
from tests.core.model.tiny import tiny_model_for
from tests.core.rank.world import analyst_inputs, make_world

N_USERS, CAP = 5, 2


@pytest.fixture(scope="module")
def world() -> Iterator[tuple[PreTrainedTokenizerFast, pd.DataFrame]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only add contention
    yield make_world(n_users=N_USERS, splits=("test", "valid"))
    torch.set_num_threads(threads)


def _params(sweep_max_requests: int | None) -> dict[str, Any]:
    return {
        "splits": ["valid", "test"],
        "max_requests": None,
        "sweep_max_requests": sweep_max_requests,
        "valid_sweep": ["cft"],
        "taus": [0.9, 0.5],
        "taus_by_system": {},
        "operating_point": {  # every key (no defaults in code): no screen, the least timing
            "systems": ["rl"],
            "reference": "ar_rl",
            "n_boot": 1000,
            "floor_screen": None,
            "speed_batch_size": 1,
            "taus": [0.5],
            "windows": [None],
            "timing": {"n_prompts": 2, "batch_sizes": [1], "rounds": 1, "min_calls": 1, "warmup": 0},
        },
        "decoding": {"max_new_tokens": 8, "batch_size": 4, "constrained": False, "device": "cpu"},
    }


def _policy() -> dict[str, Any]:
    """`params:policy` with every bar open: untrained models, every setting qualifies, the fastest
    is served (each test closes the bar it is about)."""
    return {
        "level": 0.95,
        "min_unforced_rate": 0.0,
        "min_speed_ratio": 0.0,
        "choice_margin": 1.0,
        "gate_margin": 1.0,
        "prerank_margin": 1.0,
    }


def _n_by_pass(rows: pd.DataFrame) -> dict[tuple[str, float | None], int]:
    return {(r["split"], r["tau"]): r["n"] for r in stage_metrics(rows, n_boot=10)}


def test_sweep_cap_applies_to_the_sweep_rows_only(world) -> None:
    tokenizer, requests = world
    params = _params(CAP)
    policy = _policy()
    ar_model = tiny_model_for(tokenizer)
    ar = make_rerank_node("ar_rl")(ar_model, requests, tokenizer, params, policy)
    diffusion = tiny_model_for(tokenizer, block_size=4)
    served = make_rerank_node("rl")(diffusion, requests, tokenizer, params, policy, ar, ar_model)
    swept = make_rerank_node("cft")(diffusion, requests, tokenizer, params, policy, ar, ar_model)
    assert served["operating_point"]["tau"] == 0.5 and swept["operating_point"] is None
    floor = rerank_prerank(requests, params)
    assert ar["operating_point"] is None  # one shape for every system: an AR system chooses none
    assert (
        _n_by_pass(floor) == _n_by_pass(ar["rankings"]) == {("valid", None): N_USERS, ("test", None): N_USERS}
    )
    # ar_sft is not the reference the headline pairs with: capped like the sweep on test, and not in
    # valid_sweep: no validation rows
    sft = make_rerank_node("ar_sft")(tiny_model_for(tokenizer), requests, tokenizer, params, policy)
    assert _n_by_pass(sft["rankings"]) == {("test", None): CAP}
    opd = make_rerank_node("opd")(diffusion, requests, tokenizer, params, policy, ar, ar_model)
    assert _n_by_pass(opd["rankings"]) == {("test", 0.9): CAP, ("test", 0.5): CAP}
    # rl: its candidate (tau 0.5) on every validation request, paired with ar_rl's; on test tau 0.9
    # is sweep (capped), tau 0.5 its served operating point (every request)
    assert _n_by_pass(served["rankings"]) == {
        ("valid", 0.5): N_USERS,
        ("test", 0.9): CAP,
        ("test", 0.5): N_USERS,
    }
    # cft chooses and serves nothing, and is in valid_sweep: its validation and test sweeps are capped
    assert _n_by_pass(swept["rankings"]) == {
        ("valid", 0.9): CAP,
        ("valid", 0.5): CAP,
        ("test", 0.9): CAP,
        ("test", 0.5): CAP,
    }
    for split in ("valid", "test"):  # the first CAP requests, the ones the full passes pair with
        capped = swept["rankings"][swept["rankings"]["split"] == split]
        first = select_requests(requests, split, CAP)[["user_id", "point"]]
        for _, rows in capped.groupby("tau"):
            pd.testing.assert_frame_equal(rows[["user_id", "point"]].reset_index(drop=True), first)


def test_a_candidate_far_below_the_own_valid_floor_stops_at_the_screen(world) -> None:
    """`operating_point.floor_screen`: random weights answer nothing their own, so with a floor of
    0.5 the candidate decodes only the screen's first requests on validation and is refused."""
    tokenizer, requests = world
    params = _params(CAP)
    policy = _policy()
    policy["min_unforced_rate"] = 0.5
    params["operating_point"]["floor_screen"] = {"requests": 2, "z": 1.0}
    ar_model = tiny_model_for(tokenizer)
    ar = make_rerank_node("ar_rl")(ar_model, requests, tokenizer, params, policy)
    diffusion = tiny_model_for(tokenizer, block_size=4)
    result = make_rerank_node("rl")(diffusion, requests, tokenizer, params, policy, ar, ar_model)
    point = result["operating_point"]
    assert point["tau"] is None and "own valid rate >= 0.50" in point["refused"]
    (candidate,) = point["candidates"]
    assert candidate["n"] == 2 and candidate["recall@1_vs_ar_rl.n"] == 2
    assert candidate["floor_screen"] == {"n": 2, "own_valid_upper": pytest.approx(1 / 3), "passed": False}
    assert _n_by_pass(result["rankings"])[("valid", 0.5)] == 2
    # At a floor of 0 no upper bound falls under it: every validation request is decoded.
    policy["min_unforced_rate"] = 0.0
    full = make_rerank_node("rl")(diffusion, requests, tokenizer, params, policy, ar, ar_model)
    assert _n_by_pass(full["rankings"])[("valid", 0.5)] == N_USERS


def test_each_candidate_holds_its_paired_interval_against_the_reference(world) -> None:
    """operating_point.json: every candidate's R@1 - ar_rl on the same validation requests, with the
    paired bootstrap interval; the rule reads its lower bound."""
    tokenizer, requests = world
    params = _params(CAP)
    policy = _policy()
    params["operating_point"] |= {"windows": [None, 2], "n_boot": 50}
    ar_model = tiny_model_for(tokenizer)
    ar = make_rerank_node("ar_rl")(ar_model, requests, tokenizer, params, policy)
    diffusion = tiny_model_for(tokenizer, block_size=4)
    point = make_rerank_node("rl")(diffusion, requests, tokenizer, params, policy, ar, ar_model)[
        "operating_point"
    ]
    key = "recall@1_vs_ar_rl"
    for c in point["candidates"]:
        assert c[f"{key}.n"] == N_USERS and c[f"{key}.low"] <= c[key] <= c[f"{key}.high"]
        assert c[f"{key}.half_width"] == pytest.approx((c[f"{key}.high"] - c[f"{key}.low"]) / 2)
        assert c[key] == pytest.approx(c["recall@1"] - point["reference_recall@1"])
    assert point["chosen"][f"{key}.low"] >= -policy["choice_margin"]


def test_the_operating_point_ranks_candidates_by_their_timed_speed(world) -> None:
    """With `timing`, each candidate's tokens/s is the geometric mean of its timed batch sizes."""
    tokenizer, requests = world
    params = _params(None)
    policy = _policy()
    params["operating_point"] |= {
        "windows": [None, 2],
        "timing": {"n_prompts": 3, "batch_sizes": [1, 2], "rounds": 1, "min_calls": 1, "warmup": 0},
    }
    ar_model = tiny_model_for(tokenizer)
    ar = make_rerank_node("ar_rl")(ar_model, requests, tokenizer, params, policy)
    diffusion = tiny_model_for(tokenizer, block_size=4)
    point = make_rerank_node("rl")(diffusion, requests, tokenizer, params, policy, ar, ar_model)[
        "operating_point"
    ]
    assert len(point["candidates"]) == 2
    for c in point["candidates"]:
        by_batch = c["tokens_per_s_by_batch"]
        assert set(by_batch) == {"1", "2"} and c["timed_prompts"] == 3
        assert c["tokens_per_s"] == pytest.approx((by_batch["1"] * by_batch["2"]) ** 0.5)
        assert c["pass_tokens_per_s"] > 0  # the validation pass's own figure is kept beside it
        # ar_rl timed in the same (one) round: the speed-up and its interval, the statistic named
        assert c["speedup_vs_ar_rl_low"] == c["speedup_vs_ar_rl"] == c["speedup_vs_ar_rl_high"] > 0
        assert set(c["speedup_vs_ar_rl_by_batch"]) == {"1", "2"}
        assert c["statistic"].startswith("median of 1 interleaved round")
    fastest = max(point["candidates"], key=lambda c: c["tokens_per_s"])
    assert (point["tau"], point["window"]) == (fastest["tau"], fastest["window"])
    # The speed floor reads the timed batch-1 speed-up: one no setting can reach refuses them all,
    # and a batch size the timing did not run cannot show a candidate faster than the reference.
    for floor, batch in ((1000.0, 1), (0.0, 16)):
        policy["min_speed_ratio"], params["operating_point"]["speed_batch_size"] = floor, batch
        refused = make_rerank_node("rl")(diffusion, requests, tokenizer, params, policy, ar, ar_model)[
            "operating_point"
        ]
        assert refused["tau"] is None and f"at batch {batch}" in refused["refused"]
    policy["min_speed_ratio"], params["operating_point"]["speed_batch_size"] = 0.0, 1
    floor_zero = make_rerank_node("rl")(diffusion, requests, tokenizer, params, policy, ar, ar_model)[
        "operating_point"
    ]
    assert floor_zero["tau"] is not None and floor_zero["speed_batch_size"] == 1


def test_only_candidates_that_meet_the_accuracy_gates_are_timed(world, caplog) -> None:
    """A candidate refused on the R@1 budget or the own-valid floor can never be served: not timed."""
    tokenizer, requests = world
    params = _params(None)
    policy = _policy()
    timing = {"n_prompts": 3, "batch_sizes": [1], "rounds": 1, "min_calls": 1, "warmup": 0}
    params["operating_point"] |= {"windows": [None, 2], "timing": timing}
    ar_model = tiny_model_for(tokenizer)
    ar = make_rerank_node("ar_rl")(ar_model, requests, tokenizer, params, policy)
    diffusion = tiny_model_for(tokenizer, block_size=4)
    node = make_rerank_node("rl")
    # An own-valid floor no untrained model reaches: both refused, neither timed, the reason says so.
    policy["min_unforced_rate"] = 1.0
    with caplog.at_level("INFO"):
        point = node(diffusion, requests, tokenizer, params, policy, ar, ar_model)["operating_point"]
    assert point["tau"] is None and "own valid rate >= 1.00" in point["refused"]
    assert all("tokens_per_s_by_batch" not in c and "timed_prompts" not in c for c in point["candidates"])
    assert "not timed (an R@1 margin or the own-valid floor missed" in caplog.text
    # The bars admit every setting again: all are timed, in the same rounds.
    policy["min_unforced_rate"] = 0.0
    point = node(diffusion, requests, tokenizer, params, policy, ar, ar_model)["operating_point"]
    assert all(
        c["timed_prompts"] == 3 and set(c["tokens_per_s_by_batch"]) == {"1"} for c in point["candidates"]
    )


def test_without_the_reference_model_nothing_is_timed_and_nothing_chosen(world, caplog) -> None:
    """Speed that chooses comes from the harness, beside ar_rl: without ar_rl's model the admitted
    candidates are not ranked by their validation passes' wall clock but refused, saying why."""
    tokenizer, requests = world
    params = _params(None)
    policy = _policy()
    ar = make_rerank_node("ar_rl")(tiny_model_for(tokenizer), requests, tokenizer, params, policy)
    with caplog.at_level("WARNING"):
        result = make_rerank_node("rl")(
            tiny_model_for(tokenizer, block_size=4), requests, tokenizer, params, policy, ar
        )
    point = result["operating_point"]
    assert point["tau"] is None and "ar_rl's model was not given" in point["refused"]
    assert all("timed_prompts" not in c for c in point["candidates"])
    assert "cannot be timed beside it" in caplog.text
    # no reference at all: nothing to pair with, refused before any gate
    alone = make_rerank_node("rl")(
        tiny_model_for(tokenizer, block_size=4), requests, tokenizer, params, policy
    )
    assert "no validation rankings of the reference" in alone["operating_point"]["refused"]


def test_without_a_cap_every_pass_answers_every_request(world) -> None:
    tokenizer, requests = world
    params = _params(None)
    policy = _policy()
    rows = make_rerank_node("cft")(
        tiny_model_for(tokenizer, block_size=4), requests, tokenizer, params, policy
    )
    assert set(_n_by_pass(rows["rankings"]).values()) == {N_USERS}


def test_the_analyst_answers_the_preranks_requests_with_no_model(world) -> None:
    """`rerank_analyst`: the learned analyst's noiseless order on the pre-rank's requests of every
    split (a row per request, valid, no tokens), its node on rank 0 beside the pre-rank's."""
    _, requests = world
    params = _params(CAP)
    inputs = analyst_inputs(n_users=N_USERS, splits=("test", "valid"))
    rows = rerank_analyst(
        requests, inputs["candidates"], inputs["evidence"], inputs["splits"], inputs["items"], params
    )
    floor = rerank_prerank(requests, params)
    keys = ["split", "user_id", "point", "target"]
    assert set(rows["system"]) == {"analyst"} and _n_by_pass(rows) == _n_by_pass(floor)
    pd.testing.assert_frame_equal(rows[keys], floor[keys])
    assert rows["valid"].all() and (rows["nfe"] == 0).all() and (rows["output_tokens"] == 0).all()
    assert [sorted(r) for r in rows["ranking"]] == [sorted(p) for p in floor["ranking"]]
    nodes = {n.name: n for n in create_pipeline().nodes}
    assert set(nodes["rerank_analyst"].inputs) == {
        "requests", "candidates", "evidence", "splits", "items", "params:inference"
    }  # fmt: skip
    assert nodes["combine_rankings"].inputs[:3] == ["rankings_prerank", "rankings_analyst", "reranked_ar_sft"]
    assert not nodes["rerank_analyst"].tags and not nodes["rerank_prerank"].tags  # rank 0 alone
