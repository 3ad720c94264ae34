"""Ranking metrics and bootstrap intervals against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from diffusion_gr2.core.evaluate import metrics as M
from diffusion_gr2.core.evaluate.rankings import stage_metrics

PRE = [10, 11, 12, 13, 14, 15]
ROWS = [
    {"target": 10, "ranking": [10, 11, 12, 13, 14, 15], "valid": True},  # rank 1
    {"target": 12, "ranking": [11, 10, 12, 13, 14, 15], "valid": True},  # rank 3
    {"target": 15, "ranking": PRE, "valid": False},  # invalid -> pre-rank fallback, rank 6
    {"target": 13, "ranking": [11, 13, 10, 12, 14, 15], "valid": True},  # rank 2
]


def test_per_user_metrics_by_hand() -> None:
    ranks = [1, 3, 6, 2, 0]  # 0 = target absent
    assert M.recall_at_k(ranks, 3).tolist() == [1, 1, 0, 1, 0]
    assert M.ndcg_at_k(ranks, 3) == pytest.approx([1.0, 0.5, 0.0, 1 / math.log2(3), 0.0])
    assert M.reciprocal_rank(ranks) == pytest.approx([1.0, 1 / 3, 1 / 6, 0.5, 0.0])
    assert M.target_rank([5, 6, 7], 7) == 3 and M.target_rank([5, 6], 7) == 0 and M.target_rank(None, 7) == 0


def test_system_metrics_by_hand() -> None:
    out = M.system_metrics(ROWS, n_boot=200, seed=1)
    expected = {
        "recall@1": 0.25, "recall@3": 0.75, "recall@5": 0.75,
        "ndcg@3": (1 + 0.5 + 1 / math.log2(3)) / 4, "ndcg@5": (1 + 0.5 + 1 / math.log2(3)) / 4,
        "mrr": (1 + 1 / 3 + 1 / 6 + 1 / 2) / 4, "valid_rate": 0.75, "fallback_rate": 0.25,
    }  # fmt: skip
    assert out["n"] == 4
    for key, value in expected.items():
        assert out[key] == pytest.approx(value), key
        low, high = out["ci"][key]
        assert low <= value + 1e-12 and value - 1e-12 <= high
    assert set(out["ci"]) == set(M.METRICS)
    assert M.system_metrics(pd.DataFrame(ROWS), n_boot=200, seed=1) == out  # frame or rows, same result


def test_grammar_corrected_answers_count_as_unforced_failures_and_unforced_fallbacks() -> None:
    # Served by a constrained decoder: all valid; the second and third were corrected by the grammar.
    rows = [
        {"target": 11, "ranking": [11, 10, 12], "prerank": [10, 11, 12], "valid": True, "forced": 0},
        {"target": 10, "ranking": [12, 10, 11], "prerank": [10, 11, 12], "valid": True, "forced": 2},
        {"target": 12, "ranking": [12, 10, 11], "prerank": [10, 11, 12], "valid": True, "forced": 1},
    ]
    out = M.system_metrics(rows, n_boot=10)
    assert out["valid_rate"] == 1.0 and out["fallback_rate"] == 0.0
    assert out["unforced_rate"] == pytest.approx(1 / 3)
    assert out["recall@1"] == pytest.approx(2 / 3)  # rows 1 and 3, as served
    # Serving only unforced answers, rows 2 and 3 get the pre-rank: rows 1 (model) and 2 (pre-rank) hit.
    assert out["recall@1_unforced"] == pytest.approx(2 / 3)
    rows[1]["target"] = 11  # now the pre-rank misses row 2 as well
    assert M.system_metrics(rows, n_boot=10)["recall@1_unforced"] == pytest.approx(1 / 3)
    unconstrained = [dict(r, forced=0) for r in rows[:1]]  # no `forced` -> free decoding: rates agree
    assert M.system_metrics(unconstrained, n_boot=10)["unforced_rate"] == 1.0


def test_own_answers_from_a_free_pass_decide_the_unforced_metrics() -> None:
    # A jumped diffusion pass: `forced` counts the tokens the grammar wrote, `unforced` comes from the
    # free pass, and the own answer (not the served one) is what `recall@1_unforced` serves.
    rows = [
        {
            "target": 11,
            "ranking": [10, 11, 12],
            "prerank": [10, 11, 12],
            "valid": True,
            "forced": 3,
            "unforced": True,
            "unforced_ranking": [11, 10, 12],
        },
        {
            "target": 10,
            "ranking": [10, 11, 12],
            "prerank": [12, 11, 10],
            "valid": True,
            "forced": 5,
            "unforced": False,
            "unforced_ranking": [],
        },
    ]
    out = M.system_metrics(rows, n_boot=10)
    assert out["unforced_rate"] == pytest.approx(1 / 2)  # not 0: `forced` no longer decides it
    assert out["recall@1"] == pytest.approx(1 / 2)  # row 2, as served
    assert out["recall@1_unforced"] == pytest.approx(1 / 2)  # row 1 by its own answer, row 2 pre-rank misses


def test_prerank_copy_rate_counts_own_valid_answers_that_keep_the_prerank_order() -> None:
    base = {"target": 10, "prerank": [10, 11, 12], "valid": True}
    rows = [
        base | {"ranking": [10, 11, 12], "unforced": True, "unforced_ranking": [10, 11, 12]},  # a copy
        base | {"ranking": [10, 11, 12], "unforced": True, "unforced_ranking": [11, 10, 12]},  # re-ranked
        base | {"ranking": [10, 11, 12], "unforced": False, "unforced_ranking": []},  # own answer invalid
        base | {"ranking": [12, 11, 10], "forced": 0},  # no free pass: the served answer is its own
    ]
    assert M.system_metrics(rows, n_boot=10)["prerank_copy_rate"] == pytest.approx(1 / 4)
    rows[3]["ranking"] = [10, 11, 12]
    assert M.system_metrics(rows, n_boot=10)["prerank_copy_rate"] == pytest.approx(2 / 4)
    rows[3]["forced"] = 1  # the grammar wrote part of it: not the model's own
    assert M.system_metrics(rows, n_boot=10)["prerank_copy_rate"] == pytest.approx(1 / 4)
    no_prerank = [{k: v for k, v in rows[0].items() if k != "prerank"}]
    assert M.system_metrics(no_prerank, n_boot=10)["prerank_copy_rate"] == 0.0


def test_copy_against_evidence_counts_copies_only_where_the_evidence_ranks_another_first() -> None:
    own_copy = {"target": 10, "prerank": [10, 11, 12], "valid": True, "ranking": [10, 11, 12]}
    own_copy |= {"unforced": True, "unforced_ranking": [10, 11, 12]}
    rows = [
        own_copy | {"evidence_first": 11},  # copied although the evidence put 11 first
        own_copy | {"evidence_first": 10},  # the evidence agrees with the retriever: the teacher copies too
        own_copy | {"evidence_first": 11, "unforced_ranking": [11, 10, 12]},  # followed the evidence
        own_copy | {"evidence_first": None},  # no evidence known
    ]
    out = M.system_metrics(rows, n_boot=10)
    assert out["prerank_copy_rate"] == pytest.approx(3 / 4)
    assert out["copy_against_evidence_rate"] == pytest.approx(1 / 4)


def test_stage_metrics_read_the_evidence_from_the_analysts_rows() -> None:
    def row(system: str, user: int, ranking: list[int]) -> dict:
        return {
            "split": "test",
            "system": system,
            "tau": None,
            "window": None,
            "user_id": user,
            "point": 0,
        } | {"target": 10, "prerank": [10, 11, 12], "ranking": ranking, "valid": True, "forced": 0}

    frame = pd.DataFrame(
        [row("analyst", 1, [11, 10, 12]), row("analyst", 2, [10, 12, 11])]
        + [row("ar_rl", 1, [10, 11, 12]), row("ar_rl", 2, [10, 11, 12])]  # two copies, one against it
    )
    by_system = {r["system"]: r for r in stage_metrics(frame, n_boot=10)}
    assert by_system["ar_rl"]["prerank_copy_rate"] == 1.0
    assert by_system["ar_rl"]["copy_against_evidence_rate"] == pytest.approx(1 / 2)
    assert by_system["analyst"]["copy_against_evidence_rate"] == 0.0
    without = stage_metrics(frame[frame["system"] != "analyst"], n_boot=10)
    assert without[0]["copy_against_evidence_rate"] == 0.0  # no analyst, no evidence to copy against


def test_missing_ranking_falls_back_to_prerank() -> None:
    rows = [{"target": 12, "ranking": None, "prerank": PRE, "valid": False}]
    out = M.system_metrics(rows, n_boot=10)
    assert out["recall@3"] == 1.0 and out["mrr"] == pytest.approx(1 / 3) and out["fallback_rate"] == 1.0


def test_bootstrap_matches_loop_reference_and_is_seeded(monkeypatch: pytest.MonkeyPatch) -> None:
    values = {"x": np.array([0.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.2]), "y": np.arange(7.0)}
    rng = np.random.default_rng(3)
    idx = rng.integers(0, 7, size=(300, 7))
    ref_x = np.percentile([values["x"][row].mean() for row in idx], [2.5, 97.5])
    monkeypatch.setattr(M, "_CHUNK_ELEMENTS", 20)  # force several chunks: same draws as one shot
    ci = M.bootstrap_ci(values, n_boot=300, seed=3)
    assert ci["x"] == pytest.approx(list(ref_x))
    assert ci == M.bootstrap_ci(values, n_boot=300, seed=3)
    assert ci != M.bootstrap_ci(values, n_boot=300, seed=4)
    assert M.bootstrap_ci({"c": np.full(9, 0.4)})["c"] == pytest.approx([0.4, 0.4])


def test_paired_bootstrap() -> None:
    a = np.array([1.0, 0.0, 1.0, 1.0] * 10)
    b = np.array([0.0, 0.0, 1.0, 0.0] * 10)
    res = M.paired_bootstrap(a, b, n_boot=500, seed=0, level=0.95)
    assert res.mean_diff == pytest.approx(0.5) and 0 < res.low <= 0.5 <= res.high and res.sign_share == 0.0
    same = M.paired_bootstrap(a, a, level=0.95)
    assert (same.mean_diff, same.low, same.high, same.sign_share) == (0.0, 0.0, 0.0, 1.0)
    noisy = M.paired_bootstrap([1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0], n_boot=500, level=0.95)
    assert noisy.sign_share > 0.5 and noisy.low < 0 < noisy.high
    with pytest.raises(ValueError):
        M.paired_bootstrap([1.0], [1.0, 0.0], level=0.95)


def test_full_catalog_ranks_and_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    scores = np.array([[0.9, 0.1, 0.5], [0.2, 0.2, 0.2], [-np.inf, 0.3, 0.3]])
    targets = [2, 1, 1]
    assert M.target_ranks(scores, targets).tolist() == [2, 2, 1]  # ties broken by item index
    assert M.recall_ndcg_at_k(scores, targets, 1) == pytest.approx({"recall@1": 1 / 3, "ndcg@1": 1 / 3})
    two = M.recall_ndcg_at_k(torch.tensor(scores), targets, 2)
    assert two == pytest.approx({"recall@2": 1.0, "ndcg@2": (2 / math.log2(3) + 1) / 3})
    big = np.random.default_rng(0).normal(size=(50, 40))
    tg = np.random.default_rng(1).integers(0, 40, size=50)
    full = M.target_ranks(big, tg)
    monkeypatch.setattr(M, "_CHUNK_ELEMENTS", 100)  # several user chunks give the same ranks
    assert M.target_ranks(big, tg).tolist() == full.tolist()
    assert full.tolist() == [int((big[u] > big[u, t]).sum()) + 1 for u, t in enumerate(tg)]


def test_stage_metrics_rows() -> None:
    frame = pd.DataFrame(
        [{**r, "system": "cft", "tau": 0.9} for r in ROWS] + [{**ROWS[0], "system": "prerank", "tau": 1.0}]
    )
    rows = stage_metrics(frame, n_boot=50)  # no split / window columns: test, whole block
    assert [(r["system"], r["tau"], r["n"]) for r in rows] == [("cft", 0.9, 4), ("prerank", 1.0, 1)]
    assert all(r["split"] == "test" and r["window"] is None for r in rows)
    assert rows[0]["recall@1"] == 0.25 and set(rows[1]["ci"]) == set(M.METRICS)


# ---- reasoning quality (no LLM judge) ----------------------------------------------------------------

H1, H2 = "<a_1><b_1><c_1><d_0>", "<a_2><b_2><c_2><d_0>"  # history SIDs shown in the prompt
C1, C2, C3 = "<a_5><b_5><c_5><d_0>", "<a_6><b_6><c_6><d_0>", "<a_7><b_7><c_7><d_1>"  # candidates
CONTEXT = M.PromptContext(frozenset({H1, H2, C1, C2, C3}), {501: C1, 502: C2, 503: C3})


def _answer(explanation: str, tail: str = '"recommendations":[]}') -> str:
    import json

    return '{"explanation":' + json.dumps(explanation) + "," + tail


def test_explanation_is_read_even_when_the_rest_of_the_answer_is_broken() -> None:
    assert M.explanation_of(_answer('1) likes "drama" ' + H1)) == f'1) likes "drama" {H1}'
    assert M.explanation_of(_answer("why", tail='"recommendations":["<a_5>')) == "why"  # cut off later
    assert M.explanation_of(' {"explanation" : "spaced"}') == "spaced"
    assert M.explanation_of('{"recommendations":[],"explanation":"late"}') is None  # not leading
    assert M.explanation_of('{"explanation":"never closed') is None
    assert M.explanation_of("") is None and M.explanation_of(None) is None


def test_cited_sids_are_whole_runs_of_sid_tokens() -> None:
    text = f"latest {H1}. {C1} shares X; <a_6><b_6><d_0> and {C2}{C2}<|im_end|>"
    assert M.cited_sids(text) == [H1, C1, "<a_6><b_6><d_0>", C2 + C2]  # a glued pair is one run
    # the history SID comes first but is no candidate: the stated pick is the first *candidate* cited
    assert M.stated_top_pick(f"1) {H1} 2) {C2} shares; {C1}. 3) Pick {C2}", [C1, C2, C3]) == C2
    assert M.stated_top_pick(f"only history {H1}", [C1, C2, C3]) is None


def test_reasoning_values_by_hand() -> None:
    rows = [  # (explanation, served ranking): every case of the definitions
        (f"1) {H1}. 2) {C2} shares. 3) Pick {C2}", [502, 501, 503]),  # grounded, pick agrees
        (f"1) {H1}. 2) {C1} shares. 3) Pick {C1}", [503, 501, 502]),  # grounded, pick disagrees
        (f"1) <a_1><b_1>. 2) {C3} first", [503, 502, 501]),  # truncated SID: not grounded; agrees
        ("no ids at all", [501, 502, 503]),  # no citation: not grounded, no pick
        (None, [501, 502, 503]),  # no explanation at all
    ]
    frame = pd.DataFrame(
        [
            {
                "split": "test",
                "user_id": 7,
                "output_text": "garbage" if e is None else _answer(e),
                "ranking": r,
            }
            for e, r in rows
        ]
    )
    values = M.reasoning_values(frame, {("test", 7, 0): CONTEXT}, lambda text: len(text.split()))
    assert values["explanation_rate"].tolist() == [1, 1, 1, 1, 0]
    assert values["cites_rate"].tolist() == [1, 1, 1, 0, 0]
    assert values["grounded_rate"].tolist() == [1, 1, 0, 0, 0]
    assert values["pick_agreement"].tolist() == [1, 0, 1, 0, 0]
    assert values["explanation_tokens"].tolist() == [8, 8, 5, 4, 0]  # whitespace words here


def test_reasoning_metrics_per_variant_skip_the_prerank() -> None:
    text = _answer(f"3) Pick {C1}")
    base = {
        "split": "test",
        "user_id": 7,
        "window": float("nan"),
        "output_text": text,
        "ranking": [501, 502, 503],
    }
    frame = pd.DataFrame(
        [
            base | {"system": "prerank", "tau": float("nan"), "nfe": 0, "output_text": ""},
            base | {"system": "ar_rl", "tau": float("nan"), "nfe": 12},
            base | {"system": "rl", "tau": 0.9, "nfe": 5},
            base | {"system": "rl", "tau": 0.9, "nfe": 4, "ranking": [502, 501, 503]},
        ]
    )
    rows = M.reasoning_metrics(frame, {("test", 7, 0): CONTEXT}, lambda t: 1, n_boot=50)
    assert [(r["system"], r["tau"], r["window"], r["n"]) for r in rows] == [
        ("ar_rl", None, None, 1),
        ("rl", 0.9, None, 2),
    ]
    assert rows[1]["pick_agreement"] == 0.5 and rows[1]["grounded_rate"] == 1.0
    assert set(rows[1]["ci"]) == set(M.REASONING_METRICS)


def test_prompt_contexts_read_history_and_candidates_from_the_prompt() -> None:
    requests = pd.DataFrame(
        [
            {
                "split": "test",
                "user_id": 7,
                "prompt_ids": [1, 2],
                "candidates": [501, 502],
                "candidate_sids": [C1, C2],
            }
        ]
    )
    contexts = M.prompt_contexts(requests, lambda ids: f"History: {H1} Candidates: {C1} {C2}")
    assert contexts[("test", 7, 0)] == M.PromptContext(frozenset({H1, C1, C2}), {501: C1, 502: C2})


def test_bootstrap_resamples_whole_users_when_given_them() -> None:
    """Requests of one user move together: copies of one answer do not narrow the interval."""
    values = {"recall@1": np.array([1.0] * 4 + [0.0] * 4 + [1.0, 0.0])}
    users = [7] * 4 + [8] * 4 + [9, 10]
    per_request = M.bootstrap_ci(values, n_boot=2000, seed=0)["recall@1"]
    per_user = M.bootstrap_ci(values, n_boot=2000, seed=0, groups=users)["recall@1"]
    assert per_user[1] - per_user[0] > 1.5 * (per_request[1] - per_request[0])
    # one request per user: the same resamples as no groups at all
    singles = M.bootstrap_ci(values, n_boot=500, seed=3, groups=list(range(10)))
    assert singles == M.bootstrap_ci(values, n_boot=500, seed=3)
    a, b = np.array([1.0, 1.0, 0.0, 1.0]), np.array([0.0, 0.0, 0.0, 1.0])
    paired = M.paired_bootstrap(a, b, n_boot=2000, seed=0, level=0.95, groups=[1, 1, 2, 3])
    assert paired.mean_diff == 0.5 and paired.low <= 0.5 <= paired.high
