"""Re-ranking with the decoder, the rankings contract, and the evaluation computed from it."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import PreTrainedTokenizerFast

import diffusion_gr2.core.rank.rerank as rerank_module
from diffusion_gr2.core.decode.decoder import DecodeOutput
from diffusion_gr2.core.evaluate.metrics import METRICS
from diffusion_gr2.core.evaluate.plots import metric_figure, valid_rate_figure
from diffusion_gr2.core.evaluate.rankings import (
    EvaluationConfig,
    compare_systems,
    eval_metrics,
    metrics_markdown,
    stage_metrics,
)
from diffusion_gr2.core.rank.rerank import (
    RANKING_COLUMNS,
    RerankConfig,
    decode_config_for,
    prerank_rows,
    ranking_rows,
    request_grammars,
    rerank,
    rerank_screened,
    rerank_system,
    select_requests,
)
from diffusion_gr2.core.runs.mlflow_utils import as_metrics_history
from diffusion_gr2.core.text.parser import DUPLICATE_ID, INVALID_JSON, OK
from diffusion_gr2.core.text.prompt import render_answer
from diffusion_gr2.core.text.tokenizer import IM_END
from tests.core.model.tiny import tiny_model_for
from tests.core.rank.world import make_world

STAGE_KEYS = ["system", "tau", "window", "split", "n", *METRICS, "ci"]


@pytest.fixture(scope="module")
def world() -> Iterator[tuple[PreTrainedTokenizerFast, pd.DataFrame]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only add contention
    yield make_world()
    torch.set_num_threads(threads)


def _answer_ids(tokenizer: PreTrainedTokenizerFast, text: str, eos: bool = True) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids + ([tokenizer.convert_tokens_to_ids(IM_END)] if eos else [])


def test_rerank_ar_rows_are_well_formed_and_invalid_outputs_fall_back(world) -> None:
    tokenizer, requests = world
    model = tiny_model_for(tokenizer)
    config = decode_config_for(model, tokenizer, None, RerankConfig(max_new_tokens=12, batch_size=4))
    rows = rerank(model, requests, tokenizer, config, "ar_rl", None)
    assert list(rows.columns) == list(RANKING_COLUMNS)
    assert rows["user_id"].tolist() == requests["user_id"].tolist()
    assert rows["system"].eq("ar_rl").all() and rows["tau"].isna().all()
    # 12 tokens cannot hold ten 4-token SIDs: every answer is invalid and served the pre-rank.
    assert not rows["valid"].any() and rows["reason"].ne(OK).all()
    assert rows["prerank"].tolist() == requests["candidates"].tolist() == rows["ranking"].tolist()
    assert rows["output_tokens"].between(1, 12).all()
    assert (rows["nfe"] == rows["output_tokens"]).all()  # AR: prefill + one forward per later token
    (metrics,) = stage_metrics(rows, n_boot=50)
    assert metrics["fallback_rate"] == 1.0 and metrics["valid_rate"] == 0.0
    (floor,) = stage_metrics(prerank_rows(requests), n_boot=50)
    assert metrics["recall@1"] == floor["recall@1"] and metrics["mrr"] == floor["mrr"]


def test_rerank_diffusion_records_tau_and_fewer_forwards_than_tokens(world) -> None:
    tokenizer, requests = world
    model = tiny_model_for(tokenizer, block_size=4)
    free = RerankConfig(
        max_new_tokens=16, constrained=False
    )  # a random model: the grammar would cut every run
    rows, speeds = rerank_system(model, requests, tokenizer, "cft", [(0.9, None), (0.0, 2)], free, "valid")
    assert rows["tau"].tolist() == [0.9] * len(requests) + [0.0] * len(requests)
    assert rows["window"].isna().sum() == len(requests) and (rows["window"] == 2).sum() == len(requests)
    assert (rows["split"] == "valid").all()
    assert [(s["tau"], s["window"], s["n"]) for s in speeds] == [
        (0.9, None, len(requests)),
        (0.0, 2, len(requests)),
    ]
    assert all(s["tokens_per_s"] > 0 for s in speeds)
    assert rows["output_tokens"].between(1, 16).all()
    # tau 0 commits every masked position at the first step: a block costs 2 forwards, not 4.
    low = rows[rows["tau"] == 0.0]
    assert low["nfe"].sum() < low["output_tokens"].sum()


def test_constrained_rerank_serves_the_models_own_valid_ranking(world) -> None:
    tokenizer, requests = world
    model = tiny_model_for(tokenizer, block_size=4)
    rows, _ = rerank_system(
        model, requests, tokenizer, "cft", [(0.6, None)], RerankConfig(max_new_tokens=160)
    )
    assert rows["valid"].all() and (rows["forced"] > 0).all()  # random weights: valid only by the grammar
    assert all(r != p for r, p in zip(rows["ranking"], rows["prerank"], strict=True))  # no fallback served
    (metrics,) = stage_metrics(rows, n_boot=50)
    assert (
        metrics["valid_rate"] == 1.0 and metrics["unforced_rate"] == 0.0 and metrics["fallback_rate"] == 0.0
    )


def test_a_screened_candidate_stops_at_the_head_and_a_kept_one_equals_the_full_pass(
    world, monkeypatch
) -> None:
    tokenizer, requests = world
    model = tiny_model_for(tokenizer, block_size=4)
    config = RerankConfig(max_new_tokens=48, batch_size=4)  # random weights: no answer its own
    settings = [(0.9, None), (0.6, 2)]
    full, full_speeds = rerank_system(model, requests, tokenizer, "rl", settings, config, "valid")
    # Floor 0: every setting passes the screen and decodes every request, as one full pass would.
    kept, kept_speeds = rerank_screened(model, requests, tokenizer, "rl", settings, config, 0.0, 2, 1.0)
    cols = ["tau", "window", "user_id", "point", "output_text", "ranking", "nfe", "unforced"]
    pd.testing.assert_frame_equal(kept[cols], full[cols])
    for mine, ref in zip(kept_speeds, full_speeds, strict=True):
        assert mine["floor_screen"]["passed"] and mine["floor_screen"]["n"] == 2
        same = ("tau", "window", "n", "recall@1", "unforced_rate", "tokens_per_forward")
        assert {k: mine[k] for k in same} == {k: ref[k] for k in same}
    # Floor 0.5: 0 of 2 own answers has a Wilson upper bound of 1/3 at z 1, so both stop at two.
    cut, cut_speeds = rerank_screened(model, requests, tokenizer, "rl", settings, config, 0.5, 2, 1.0)
    assert len(cut) == 2 * len(settings)
    assert cut["user_id"].tolist() == requests["user_id"].head(2).tolist() * len(settings)
    assert [(s["n"], s["floor_screen"]["passed"]) for s in cut_speeds] == [(2, False)] * len(settings)
    assert [s["unforced_rate"] for s in cut_speeds] == [0.0, 0.0]
    # One kept, one stopped: each setting's rows are its own pass's, the kept one's whole.
    verdicts = iter([True, False])
    monkeypatch.setattr(
        rerank_module,
        "floor_screen",
        lambda rate, n, floor, z: {"n": n, "own_valid_upper": math.nan, "passed": next(verdicts)},
    )
    mixed, mixed_speeds = rerank_screened(model, requests, tokenizer, "rl", settings, config, 0.5, 2, 1.0)
    first = full[full["tau"] == 0.9].reset_index(drop=True)
    pd.testing.assert_frame_equal(mixed[mixed["tau"] == 0.9].reset_index(drop=True)[cols], first[cols])
    assert len(mixed[mixed["tau"] == 0.6]) == 2 and [s["n"] for s in mixed_speeds] == [len(requests), 2]
    assert mixed_speeds[0]["recall@1"] == full_speeds[0]["recall@1"]


def test_decode_config_for_reads_model_and_tokenizer(world) -> None:
    tokenizer, _ = world
    diffusion = tiny_model_for(tokenizer, block_size=4)
    cfg = decode_config_for(diffusion, tokenizer, 0.6, RerankConfig(max_new_tokens=40, batch_size=3))
    assert (cfg.block_size, cfg.threshold, cfg.mask_token_id) == (4, 0.6, tokenizer.mask_token_id)
    assert cfg.eos_token_ids == (tokenizer.convert_tokens_to_ids(IM_END),)
    assert (cfg.pad_token_id, cfg.max_new_tokens, cfg.batch_size) == (tokenizer.pad_token_id, 40, 3)
    assert decode_config_for(diffusion, tokenizer, None, RerankConfig()).block_size == 1  # AR: no tau
    assert cfg.commit_rule == "prefix"  # the served default ...
    paper_rule = RerankConfig(commit_rule="confident")  # ... and the parameter reaches the decoder
    assert decode_config_for(diffusion, tokenizer, 0.6, paper_rule).commit_rule == "confident"
    with pytest.raises(ValueError, match="block_size"):
        decode_config_for(tiny_model_for(tokenizer), tokenizer, 0.9, RerankConfig())
    # The SID tau reaches diffusion decoding with the tokenizer's SID-code ids; AR decoding ignores it.
    strict = RerankConfig(sid_threshold=0.99)
    sid_cfg = decode_config_for(diffusion, tokenizer, 0.6, strict)
    codes = {tokenizer.convert_ids_to_tokens(i) for i in sid_cfg.sid_token_ids}
    assert sid_cfg.sid_threshold == 0.99 and codes and all(re.fullmatch(r"<[a-z]_\d+>", t) for t in codes)
    assert (cfg.sid_threshold, cfg.sid_token_ids) == (0.99, sid_cfg.sid_token_ids)  # default: as served
    plain = decode_config_for(diffusion, tokenizer, 0.6, RerankConfig(sid_threshold=None))
    assert (plain.sid_threshold, plain.sid_token_ids) == (None, frozenset())  # None: tau everywhere
    assert decode_config_for(diffusion, tokenizer, None, strict).sid_threshold is None
    # Its scope: every SID code (no marker), or the ranking list's only (after the list's key)
    assert sid_cfg.sid_after == ()
    listed = decode_config_for(diffusion, tokenizer, 0.6, dataclasses.replace(strict, sid_scope="list"))
    assert (
        tokenizer.decode(listed.sid_after) == "recommendations"
        and listed.sid_token_ids == sid_cfg.sid_token_ids
    )
    with pytest.raises(ValueError, match="sid_scope"):
        decode_config_for(diffusion, tokenizer, 0.6, dataclasses.replace(strict, sid_scope="explanation"))


def test_drafts_reach_ar_systems_only_and_change_no_ranking(world) -> None:
    """`RerankConfig.draft` turns prompt lookup on for AR systems (off by default); diffusion systems
    decode without drafts whatever it says; the rankings are the same, with fewer forwards."""
    tokenizer, requests = world
    ar, diffusion = tiny_model_for(tokenizer), tiny_model_for(tokenizer, block_size=4)
    drafted = RerankConfig(max_new_tokens=96, draft="prompt", draft_tokens=5)
    cfg = decode_config_for(ar, tokenizer, None, drafted)
    assert (cfg.draft, cfg.draft_tokens) == ("prompt", 5)
    assert decode_config_for(ar, tokenizer, None, RerankConfig()).draft is None  # served default: off
    assert decode_config_for(diffusion, tokenizer, 0.6, drafted).draft is None
    copying = dataclasses.replace(drafted, copy_drafts=True)  # diffusion's own switch: copy drafts
    copy_config = decode_config_for(diffusion, tokenizer, 0.6, copying)
    assert copy_config.copy_drafts and copy_config.draft is None  # lossy copies, no lossless drafts
    ar_config = decode_config_for(ar, tokenizer, None, dataclasses.replace(copying, draft=None))
    assert ar_config.draft is None and not ar_config.copy_drafts
    grammars = request_grammars(tokenizer, requests)
    plain = rerank(ar, requests, tokenizer, dataclasses.replace(cfg, draft=None), "ar_rl", None, grammars)
    rows = rerank(ar, requests, tokenizer, cfg, "ar_rl", None, grammars)
    same = [c for c in RANKING_COLUMNS if c != "nfe"]
    pd.testing.assert_frame_equal(rows[same], plain[same])
    assert rows["nfe"].sum() <= plain["nfe"].sum()


def test_ranking_rows_map_valid_sids_to_items_and_fall_back_otherwise(world) -> None:
    tokenizer, requests = world
    reqs = requests.head(3)
    sids = [list(s) for s in reqs["candidate_sids"]]
    texts = [
        render_answer("best first", sids[0][::-1]),  # valid: the reversed pre-rank
        render_answer("dup", [sids[1][0], *sids[1][:-1]]),  # duplicate id
        render_answer("cut", sids[2]),  # truncated: no end token, half a JSON object
    ]
    ids = [
        _answer_ids(tokenizer, texts[0]),
        _answer_ids(tokenizer, texts[1]),
        _answer_ids(tokenizer, texts[2])[:30],
    ]
    outputs = [DecodeOutput(t, [0] * len(t), len(t), [0.0] * len(t)) for t in ids]
    rows = ranking_rows(reqs, outputs, tokenizer, "rl", 0.9)
    cands = [list(c) for c in reqs["candidates"]]
    assert rows["valid"].tolist() == [True, False, False]
    assert rows["reason"].tolist() == [OK, DUPLICATE_ID, INVALID_JSON]
    assert rows["ranking"].tolist() == [cands[0][::-1], cands[1], cands[2]]
    assert rows["output_text"][0] == texts[0]  # the end token is not part of the text
    assert rows["output_tokens"].tolist() == [len(t) for t in ids]
    (metrics,) = stage_metrics(rows, n_boot=20)
    assert metrics["valid_rate"] == pytest.approx(1 / 3) and metrics["fallback_rate"] == pytest.approx(2 / 3)


def _hand_requests(positions: list[int], split: str = "test") -> pd.DataFrame:
    """Requests whose target sits at the given 1-based pre-rank positions among 10 candidates."""
    rows = []
    for u, pos in enumerate(positions):
        cands = list(range(100 * u, 100 * u + 10))
        rows.append(
            {"user_id": u, "split": split, "point": 0, "target": cands[pos - 1], "target_position": pos}
        )
        rows[-1] |= {
            "candidates": cands,
            "candidate_sids": [f"<a_{i}>" for i in range(10)],
            "prompt_ids": [1],
        }
    return pd.DataFrame(rows)


def test_prerank_rows_metrics_equal_hand_computed_values() -> None:
    rows = prerank_rows(_hand_requests([1, 2, 4, 7]))
    assert list(rows.columns) == list(RANKING_COLUMNS)
    assert rows["valid"].all() and (rows["output_tokens"] == 0).all() and (rows["nfe"] == 0).all()
    (m,) = stage_metrics(rows, n_boot=50)
    expected = {
        "recall@1": 1 / 4,
        "recall@3": 2 / 4,
        "recall@5": 3 / 4,
        "ndcg@3": (1 + 1 / math.log2(3)) / 4,
        "ndcg@5": (1 + 1 / math.log2(3) + 1 / math.log2(5)) / 4,
        "mrr": (1 + 1 / 2 + 1 / 4 + 1 / 7) / 4,
        "valid_rate": 1.0,
        "fallback_rate": 0.0,
    }
    assert {k: m[k] for k in expected} == pytest.approx(expected)
    assert (m["system"], m["tau"], m["n"]) == ("prerank", None, 4)


def _rankings() -> pd.DataFrame:
    """prerank, an AR system (no tau) and a diffusion system at two taus over the same 6 users."""
    reqs = _hand_requests([1, 2, 3, 5, 8, 10])
    floor = prerank_rows(reqs)
    ar = floor.assign(system="ar_rl", valid=[True, True, False, True, True, True], output_tokens=30, nfe=30)
    best_first = [[t, *[c for c in p if c != t]] for t, p in zip(ar["target"], ar["prerank"], strict=True)]
    best_first[2] = list(ar["prerank"][2])  # the invalid row is served the pre-rank
    ar["ranking"] = best_first
    cft9 = floor.assign(system="cft", tau=0.9, output_tokens=30, nfe=12)
    cft6 = floor.assign(system="cft", tau=0.6, output_tokens=30, nfe=8, valid=False)
    return pd.concat([floor, ar, cft9, cft6], ignore_index=True)


def test_stage_metrics_are_recomputable_from_the_rankings_file(tmp_path: Path) -> None:
    rankings = _rankings()
    rankings.to_parquet(tmp_path / "rankings.parquet")
    reread = pd.read_parquet(tmp_path / "rankings.parquet")
    rows = stage_metrics(reread, n_boot=100)
    assert rows == stage_metrics(rankings, n_boot=100)
    assert [list(r) for r in rows] == [STAGE_KEYS] * 4
    assert [(r["system"], r["tau"], r["n"]) for r in rows] == [
        ("prerank", None, 6),
        ("ar_rl", None, 6),
        ("cft", 0.9, 6),
        ("cft", 0.6, 6),
    ]
    by_hand = [
        np.mean([rank[0] == t for rank, t in zip(g["ranking"], g["target"], strict=True)])
        for _, g in reread.groupby(["system", "tau"], sort=False, dropna=False)
    ]
    assert [r["recall@1"] for r in rows] == pytest.approx(by_hand)
    assert rows[1]["recall@1"] == pytest.approx(5 / 6) and rows[1]["fallback_rate"] == pytest.approx(1 / 6)
    low, high = rows[1]["ci"]["recall@1"]
    assert low <= rows[1]["recall@1"] <= high


def test_compare_systems_pairs_users_against_each_baseline() -> None:
    rankings = _rankings()
    rows = compare_systems(rankings, EvaluationConfig(n_boot=200), 0.95)
    keys = {"system", "tau", "window", "split", "baseline", "baseline_tau", "metric", "n", "mean_diff"}
    keys |= {"low", "high", "sign_share"}
    assert all(set(r) == keys for r in rows)
    assert all(r["system"] != r["baseline"] for r in rows)
    assert len(rows) == 2 * 3 * 2  # 2 baselines x 3 other (system, tau) x 2 metrics
    same = [r for r in rows if r["system"] == "cft" and r["tau"] == 0.9 and r["baseline"] == "prerank"]
    assert all(r["mean_diff"] == 0.0 and r["sign_share"] == 1.0 for r in same)
    ar_vs_floor = next(r for r in rows if r["system"] == "ar_rl" and r["baseline"] == "prerank")
    assert ar_vs_floor["metric"] == "recall@1" and ar_vs_floor["mean_diff"] == pytest.approx(5 / 6 - 1 / 6)


def test_eval_metrics_names_and_markdown_table() -> None:
    rankings = _rankings()
    rows = stage_metrics(rankings, n_boot=20)
    history = as_metrics_history(
        eval_metrics(rows, compare_systems(rankings, EvaluationConfig(n_boot=20), 0.95))
    )
    assert history["cft.tau0.9.recall_at_1"]["value"] == rows[2]["recall@1"]
    assert history["ar_rl.ndcg_at_3"]["value"] == rows[1]["ndcg@3"]
    assert history["cmp.cft.tau0.6.vs_ar_rl.recall_at_1"]["value"] == pytest.approx(1 / 6 - 5 / 6)
    table = metrics_markdown(rows)
    assert (
        table.count("\n| ") == 5
        and "| test | cft | 0.9 | — | 6 |" in table
        and "| test | ar_rl | — | — | 6 |" in table
    )
    assert "intervals over users" in table  # `stage_metrics` resamples users, not requests


def test_select_requests_filters_sorts_and_caps() -> None:
    reqs = pd.concat([_hand_requests([1, 2, 3]).iloc[::-1], _hand_requests([4], split="valid")])
    assert select_requests(reqs)["user_id"].tolist() == [0, 1, 2]
    assert select_requests(reqs, max_requests=2)["user_id"].tolist() == [0, 1]
    assert select_requests(reqs, split="valid")["user_id"].tolist() == [0]


def test_plots_render_to_png(tmp_path: Path) -> None:
    rows = stage_metrics(_rankings(), n_boot=20)
    for name, fig in {"r1": metric_figure(rows), "valid": valid_rate_figure(rows)}.items():
        fig.savefig(tmp_path / f"{name}.png")
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_systems_are_paired_by_request_not_by_user() -> None:
    """Two points of one user are two requests: the pairing matches (split, user, point), not row order."""
    reqs = pd.concat([_hand_requests([1, 1, 4]), _hand_requests([2, 1, 2])], ignore_index=True)
    reqs["point"] = [0, 0, 0, 1, 1, 1]
    floor = prerank_rows(reqs)  # R@1 1, 1, 0 at point 0; 0, 1, 0 at point 1
    same = floor.assign(system="ar_rl").iloc[::-1]  # the same answers, rows in another order
    (cmp,) = [
        c
        for c in compare_systems(pd.concat([floor, same]), EvaluationConfig(n_boot=50), 0.95)
        if c["metric"] == "recall@1" and c["baseline"] == "prerank"
    ]
    assert (cmp["n"], cmp["mean_diff"], cmp["low"], cmp["high"]) == (6, 0.0, 0.0, 0.0)
    # a pass decoded on fewer requests (the capped tau sweep) is paired on those only
    sweep = floor.iloc[:2].assign(system="rl", tau=0.6, ranking=[[1], [101]])  # misses both targets
    rows = compare_systems(
        pd.concat([floor, sweep]), EvaluationConfig(n_boot=50, compare_metrics=("recall@1",)), 0.95
    )
    assert [(r["system"], r["n"], r["mean_diff"]) for r in rows] == [("rl", 2, -1.0)]


def test_select_requests_orders_by_point_then_user() -> None:
    reqs = pd.concat([_hand_requests([1, 2, 3]), _hand_requests([4, 5, 6])], ignore_index=True)
    reqs["point"] = [1, 1, 1, 0, 0, 0]
    rows = select_requests(reqs, max_requests=4)
    assert list(zip(rows["point"], rows["user_id"], strict=True)) == [(0, 0), (0, 1), (0, 2), (1, 0)]


def test_own_answers_are_read_off_a_free_pass_when_the_served_pass_jumps(world, monkeypatch) -> None:
    """Diffusion with jump-forward writes tokens the model never chose, so `unforced` comes from a
    second, unconstrained pass; AR (exact jump-forward) and no-jump passes read it off `forced`."""
    import dataclasses

    from diffusion_gr2.core.rank import rerank as module

    tokenizer, requests = world
    grammars = module.request_grammars(tokenizer, requests)
    sids = [str(s) for s in requests["candidate_sids"][0]]
    good = DecodeOutput(_answer_ids(tokenizer, render_answer("ok", sids[::-1])), [], 1, [])
    bad = DecodeOutput(_answer_ids(tokenizer, render_answer("ok", sids[:-1])), [], 1, [])
    own = module.own_answers(
        [good, bad], requests.head(2)["candidate_sids"], tokenizer, grammars[:1] * 2, 160
    )
    assert own[0] == (True, sids[::-1]) and own[1] == (False, [])
    rows = ranking_rows(requests.head(2), [good, bad], tokenizer, "cft", 0.9, own=own)
    items = [int(i) for i in requests["candidates"][0]]
    assert rows["unforced"].tolist() == [True, False]
    assert rows["unforced_ranking"][0] == items[::-1] and len(rows["unforced_ranking"][1]) == 0

    calls: list[bool] = []
    decode_requests = module.decode_requests

    def counted(model, prompts, config, desc="decode", grammars=None):  # type: ignore[no-untyped-def]
        calls.append(grammars is not None)
        return decode_requests(model, prompts, config, desc, grammars)

    monkeypatch.setattr(module, "decode_requests", counted)
    model = tiny_model_for(tokenizer, block_size=4)
    cfg = decode_config_for(model, tokenizer, 0.6, RerankConfig(max_new_tokens=96))
    jumped = rerank(model, requests, tokenizer, cfg, "cft", 0.6, grammars)
    assert calls == [True, False]  # the served pass, then the free one
    calls.clear()
    plain = rerank(
        model, requests, tokenizer, dataclasses.replace(cfg, jump_forward=False), "cft", 0.6, grammars
    )
    assert calls == [True]
    # without jump-forward an accepted free answer is exactly a served answer with no correction
    assert jumped["unforced"].tolist() == (plain["valid"] & (plain["forced"] == 0)).tolist()
    calls.clear()
    ar = tiny_model_for(tokenizer)
    rerank(
        ar,
        requests,
        tokenizer,
        decode_config_for(ar, tokenizer, None, RerankConfig(max_new_tokens=96)),
        "ar_rl",
        None,
        grammars,
    )
    assert calls == [True]
