"""Decode benchmark: settings, rows, output-token accounting, calls per setting, speed-ups, plots."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterator

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.base.speed import statistic
from diffusion_gr2.core.bench import benchmark as bench
from diffusion_gr2.core.bench.benchmark import (
    BENCHMARK_KEYS,
    GENERATE,
    BenchmarkConfig,
    TimedSetting,
    add_speedups,
    format_table,
    plan_length_settings,
    plan_settings,
    run_benchmark,
    speedup_by_length,
    time_candidates,
)
from diffusion_gr2.core.bench.harness import Call, calls_per_round
from diffusion_gr2.core.decode.decoder import decode
from diffusion_gr2.core.evaluate.plots import speedup_by_batch_figure, speedup_by_length_figure
from diffusion_gr2.core.evaluate.policy import Policy
from diffusion_gr2.core.rank.operating_point import ranked_speed, refused_operating_point
from diffusion_gr2.core.rank.rerank import RerankConfig, decode_config_for, request_grammars
from diffusion_gr2.core.text.tokenizer import IM_END
from tests.core.model.tiny import tiny_model_for
from tests.core.rank.world import make_world

MAX_NEW = 8
# The core keys of a `benchmark.json` row (docs/architecture.md#names-and-report-files); the benchmark
# adds `window`, `operating_point`, the speed-up's interval, the statistic's name and the per-round
# figures (issue 28).
CORE_KEYS = {
    "system",
    "tau",
    "batch_size",
    "constrained",
    "backend",
    "output_tokens_per_s",
    "nfe_per_sample",
    "tokens_per_forward",
    "latency_p50_ms",
    "latency_p95_ms",
    "mean_output_tokens",
    "device",
    "speedup_vs_ar",
}


@pytest.fixture(scope="module")
def world() -> Iterator[tuple[PreTrainedTokenizerFast, list[list[int]], list]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only add contention
    tokenizer, requests = make_world(n_users=3)
    yield tokenizer, [list(p) for p in requests["prompt_ids"]], request_grammars(tokenizer, requests)
    torch.set_num_threads(threads)


def forced_model(
    tokenizer: PreTrainedTokenizerFast, token_id: int, block_size: int | None = None
) -> PreTrainedModel:
    """A model that predicts `token_id` everywhere with probability ~1: zero LM-head weights + a bias."""
    model = tiny_model_for(tokenizer, block_size)
    head = torch.nn.Linear(model.config.hidden_size, len(tokenizer), bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[token_id] = 50.0
    model.set_output_embeddings(head)
    return model


class TickingClock:
    """A fake clock that advances one second per reading: every timed call lasts exactly 1 s."""

    def __init__(self) -> None:
        self.readings = 0
        self._count: Callable[[], int] = itertools.count().__next__

    def __call__(self) -> float:
        self.readings += 1
        return float(self._count())


def spy_on_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, int]]:
    """Every decode call the harness makes, in order: (its setting's key, batch size)."""
    calls: list[tuple[object, int]] = []
    real = bench.time_rounds

    def spy(systems, *args, **kwargs):
        def logged(key, system):
            def run(batch):
                calls.append((key, len(batch)))
                return system.run(batch)

            return dataclasses.replace(system, run=run)

        return real({k: logged(k, s) for k, s in systems.items()}, *args, **kwargs)

    monkeypatch.setattr(bench, "time_rounds", spy)
    return calls


def turns(calls: list[tuple[object, int]]) -> list[tuple[int, int]]:
    """(batch size, calls) of each run of consecutive calls of one setting."""
    out: list[list] = []
    for key, b in calls:
        if out and out[-1][0] == key:
            out[-1][2] += 1
        else:
            out.append([key, b, 1])
    return [(b, n) for _, b, n in out]


def point(tau: float, window: int | None) -> dict:
    """An operating_point.json entry as `choose_operating_point` writes it (the fields the benchmark reads)."""
    return {"tau": tau, "window": window, "budget": 0.01, "refused": None}


def _config(prompts, **kw) -> BenchmarkConfig:
    base = dict(n_prompts=len(prompts), batch_sizes=(1, 4), taus=(0.9,), warmup=1, rounds=1, min_calls=1)
    base |= dict(constrained=(False,), sweep_systems=(), sweep_batch_sizes=(1,), sweep_constrained=(False,))
    base |= dict(length_budgets=())
    # no drafted rows, every system at `batch_sizes`, an unserved system at tau 0.9 (the sweep's tau)
    base |= dict(prompt_lookup_tokens=None, drafter=None, system_batch_sizes={}, unserved_tau=0.9)
    return BenchmarkConfig(**(base | kw))


def _ungated(max_new: int = MAX_NEW) -> RerankConfig:
    """No repeat gate: `forced_model` writes one token everywhere, which the gate would commit one
    forward at a time (DecodeConfig.repeat_gate; its tests are the decoder's)."""
    return RerankConfig(max_new_tokens=max_new, repeat_gate=False)


def _bench(models, tokenizer, prompts, points=None, grammars=None, max_new=MAX_NEW, **kw):
    decoding = _ungated(max_new)
    config = _config(prompts, **kw)
    return run_benchmark(
        models, prompts, tokenizer, decoding, config, TickingClock(), grammars, operating_points=points
    )


def _row(rows, system, batch_size=1, constrained=False, **match):
    (row,) = [
        r
        for r in rows
        if r["system"] == system
        and r["batch_size"] == batch_size
        and r["constrained"] == constrained
        and all(r[k] == v for k, v in match.items())
    ]
    return row


def test_benchmark_keys_are_the_core_ones_plus_window_operating_point_and_the_interval() -> None:
    extra = {"speedup_vs_ar_low", "speedup_vs_ar_high", "statistic", "tokens_per_s_by_round"}
    extra |= {"speedup_vs_best_ar", "speedup_vs_best_ar_low", "speedup_vs_best_ar_high", "best_ar"}
    assert set(BENCHMARK_KEYS) == CORE_KEYS | {"window", "operating_point"} | extra
    assert len(BENCHMARK_KEYS) == len(set(BENCHMARK_KEYS))


def test_throughput_counts_output_tokens_only(world) -> None:
    tokenizer, prompts, _ = world  # prompts are ~460 tokens: counting them would dwarf the output
    never_ends = forced_model(tokenizer, tokenizer.convert_tokens_to_ids("<a_3>"))
    stops_at_once = forced_model(tokenizer, tokenizer.convert_tokens_to_ids(IM_END))
    rows = _bench({"ar_rl": never_ends}, tokenizer, prompts).rows
    long = {r["batch_size"]: r for r in rows if r["system"] == "ar_rl"}
    assert long[1]["mean_output_tokens"] == MAX_NEW and long[1]["output_tokens_per_s"] == MAX_NEW  # 3 x 1 s
    assert long[1]["latency_p50_ms"] == long[1]["latency_p95_ms"] == 1000.0  # each request waits 1 s
    # batch 4 cycles the 3 prompts into one full batch: 4 rows x 8 tokens in one 1-s call.
    assert long[4]["output_tokens_per_s"] == 4 * MAX_NEW and long[4]["latency_p50_ms"] == 1000.0
    assert long[1]["nfe_per_sample"] == MAX_NEW and long[1]["tokens_per_forward"] == 1.0
    short = _row(_bench({"ar_rl": stops_at_once}, tokenizer, prompts).rows, "ar_rl")
    assert short["mean_output_tokens"] == 1 and short["output_tokens_per_s"] == 1.0  # the end token only


def test_rows_have_exactly_the_keys_and_each_system_its_operating_point(world) -> None:
    tokenizer, prompts, _ = world
    token = tokenizer.convert_tokens_to_ids("<a_3>")
    models = {"cft": forced_model(tokenizer, token, block_size=4), "ar_rl": forced_model(tokenizer, token)}
    result = _bench(models, tokenizer, prompts, points={"cft": point(0.6, 2)})
    assert all(list(r) == list(BENCHMARK_KEYS) for r in result.rows)
    settings = [(r["system"], r["tau"], r["window"], r["batch_size"]) for r in result.rows]
    assert settings == [
        (s, t, w, b)
        for s, t, w in (("ar_rl", None, None), (GENERATE, None, None), ("cft", 0.6, 2))
        for b in (1, 4)
    ]  # the reference first, then generate on its weights, then the diffusion system at its point
    assert all(r["operating_point"] and not r["constrained"] for r in result.rows)
    # the forward each row really ran: our decoder's default (auto) is lean on these Qwen3 models
    assert [r["backend"] for r in result.rows] == ["lean", "lean", "eager", "eager", "lean", "lean"]
    assert all(r["device"].startswith("cpu") for r in result.rows)
    cft = _row(result.rows, "cft")
    cfg = decode_config_for(models["cft"], tokenizer, 0.6, _ungated())
    direct = decode(models["cft"], prompts, dataclasses.replace(cfg, window=2))  # the window is passed on
    assert cft["nfe_per_sample"] == sum(o.nfe for o in direct) / len(direct)
    whole = decode(models["cft"], prompts, cfg)
    assert sum(o.nfe for o in direct) > sum(o.nfe for o in whole)  # window 2 < block 4: more forwards
    assert cft["tokens_per_forward"] > 1.5  # confident model: several tokens per forward
    assert "cft τ=0.6 w2" in format_table(result.rows) and "tok/s" in format_table(result.rows)


def test_generate_row_decodes_ar_rls_weights_free_and_under_the_grammar(world) -> None:
    tokenizer, prompts, grammars = world
    ar = tiny_model_for(tokenizer)  # random weights: the grammar really has to correct them
    result = _bench(
        {"ar_rl": ar},
        tokenizer,
        prompts,
        grammars=grammars,
        max_new=16,
        batch_sizes=(2,),
        constrained=(True, False),
    )
    for constrained in (True, False):
        ours, hf = _row(result.rows, "ar_rl", 2, constrained), _row(result.rows, GENERATE, 2, constrained)
        assert hf["mean_output_tokens"] == ours["mean_output_tokens"]  # the same tokens (pinned elsewhere)
        assert hf["tokens_per_forward"] == 1.0 and hf["operating_point"] and hf["tau"] is None
    free_only = plan_settings(
        ["ar_rl"], None, BenchmarkConfig(constrained=(True, False), generate_constrained=False)
    )
    assert {s.constrained for s in free_only if s.system == GENERATE} == {False}


def test_speedup_is_the_ratio_to_ar_rl_at_the_same_batch_size_and_grammar_flag() -> None:
    def row(system, b, constrained, tps, drift=(1.0, 0.5, 0.8)):
        rounds = [tps * d for d in drift]  # the machine's speed moves from round to round
        return {
            "system": system,
            "batch_size": b,
            "constrained": constrained,
            "tokens_per_s_by_round": rounds,
        }

    rows = [
        row("ar_rl", 1, True, 10.0),
        row("ar_rl", 1, False, 20.0),
        row("ar_rl", 4, True, 40.0),
        row("rl", 1, True, 30.0),
        row("rl", 1, False, 30.0),
        row("rl", 4, True, 80.0, drift=(1.0, 0.6, 0.8)),  # round 2 disturbed less for rl than for ar_rl
        row(GENERATE, 16, False, 5.0),  # the reference was not timed at batch 16
    ]
    out = add_speedups(rows)
    got = [r["speedup_vs_ar"] for r in out]
    assert got == pytest.approx([1.0, 1.0, 1.0, 3.0, 1.5, 2.0, None])  # paired by round: drift cancels
    bounds = [x for r in out[:5] for x in (r["speedup_vs_ar_low"], r["speedup_vs_ar_high"])]
    assert bounds == pytest.approx([1.0] * 6 + [3.0, 3.0, 1.5, 1.5])  # the same ratio every round
    assert (out[5]["speedup_vs_ar_low"], out[5]["speedup_vs_ar_high"]) == pytest.approx((2.0, 2.4))
    assert out[6]["speedup_vs_ar_low"] is None and out[6]["speedup_vs_ar_high"] is None


def test_prompt_lookup_rows_decode_the_same_tokens_and_the_best_ar_row_is_named(world) -> None:
    """`ar_rl+pld` at every batch size, both flags; `generate+pld` at batch 1, free only (the library's
    own); the same output lengths as plain `ar_rl` (lossless; tokens pinned in test_draft.py)."""
    tokenizer, prompts, grammars = world
    ar = tiny_model_for(tokenizer)
    result = _bench(
        {"ar_rl": ar},
        tokenizer,
        prompts,
        grammars=grammars,
        max_new=16,
        batch_sizes=(1, 2),
        constrained=(True, False),
        prompt_lookup_tokens=3,
    )
    names = {(r["system"], r["batch_size"], r["constrained"]) for r in result.rows}
    assert {("ar_rl+pld", b, c) for b in (1, 2) for c in (True, False)} <= names
    assert ("generate+pld", 1, False) in names and ("generate+pld", 1, True) not in names
    for b in (1, 2):
        for c in (True, False):
            plain, drafted = _row(result.rows, "ar_rl", b, c), _row(result.rows, "ar_rl+pld", b, c)
            assert drafted["mean_output_tokens"] == plain["mean_output_tokens"]
            assert drafted["nfe_per_sample"] <= plain["nfe_per_sample"]
    hf = _row(result.rows, "generate+pld", 1, False)
    assert hf["mean_output_tokens"] == _row(result.rows, "ar_rl", 1, False)["mean_output_tokens"]
    assert hf["nfe_per_sample"] is None and hf["tokens_per_forward"] is None  # generate does not count
    for r in result.rows:
        ar_rows = [
            x
            for x in result.rows
            if x["batch_size"] == r["batch_size"]
            and x["constrained"] == r["constrained"]
            and x["tau"] is None
        ]
        fastest = max(ar_rows, key=lambda x: x["output_tokens_per_s"])
        assert r["best_ar"] == fastest["system"] and r["speedup_vs_best_ar"] is not None
    assert "ar_rl+pld" in format_table(result.rows)


def test_the_diffusion_drafted_row_writes_the_references_tokens_and_counts_as_an_ar_row(world) -> None:
    """`ar_rl+rl-draft`: rl drafts, ar_rl verifies (tokens pinned in test_draft.py): ar_rl's output
    lengths in no more forwards, at the drafter's batch sizes under both flags; as a lossless AR row
    it may be the `best_ar` of the others."""
    tokenizer, prompts, grammars = world
    ar = tiny_model_for(tokenizer)
    result = _bench(
        {"ar_rl": ar, "rl": tiny_model_for(tokenizer, block_size=4)},
        tokenizer,
        prompts,
        points={"rl": point(0.9, None)},
        grammars=grammars,
        max_new=16,
        batch_sizes=(1, 2),
        constrained=(True, False),
        drafter="rl",
        drafter_tokens=None,  # the drafter's whole block (4)
        drafter_batch_sizes=(1,),
    )
    drafted = {(r["batch_size"], r["constrained"]) for r in result.rows if r["system"] == "ar_rl+rl-draft"}
    assert drafted == {(1, True), (1, False)}
    for c in (True, False):
        plain, row = _row(result.rows, "ar_rl", 1, c), _row(result.rows, "ar_rl+rl-draft", 1, c)
        assert row["mean_output_tokens"] == plain["mean_output_tokens"] and row["tau"] is None
        assert row["nfe_per_sample"] <= plain["nfe_per_sample"]
    rows = [
        {
            "system": s,
            "batch_size": 1,
            "constrained": True,
            "tokens_per_s_by_round": [t],
            "output_tokens_per_s": t,
        }
        for s, t in (("ar_rl", 10.0), ("ar_rl+rl-draft", 20.0), ("rl", 30.0), ("ar_rl+cft-draft", 15.0))
    ]
    assert [r["best_ar"] for r in add_speedups(rows)] == ["ar_rl+rl-draft"] * 4
    assert add_speedups(rows)[2]["speedup_vs_best_ar"] == pytest.approx(1.5)


def test_graphs_rows_time_the_static_step_of_the_reference_and_each_served_line(world) -> None:
    """`<system>+graphs` (the static decode step; CUDA graphs on a GPU) twins the reference's rows and
    each diffusion system's served line at `graphs_batch_sizes`, not its sweep: the same output
    lengths and forwards as the plain rows (tokens pinned in tests/core/decode/test_static.py)."""
    tokenizer, prompts, grammars = world
    models = {"ar_rl": tiny_model_for(tokenizer), "rl": tiny_model_for(tokenizer, block_size=4)}
    result = _bench(
        models,
        tokenizer,
        prompts,
        points={"rl": point(0.9, None)},
        grammars=grammars,
        constrained=(True, False),
        batch_sizes=(1, 2),
        graphs_batch_sizes=(2,),
        taus=(0.6,),
        sweep_systems=("rl",),
        sweep_batch_sizes=(2,),
    )
    graphed = {
        (r["system"], r["batch_size"], r["constrained"]) for r in result.rows if "+graphs" in r["system"]
    }
    assert graphed == {(s, 2, c) for s in ("ar_rl+graphs", "rl+graphs") for c in (True, False)}
    for system, tau in (("ar_rl", None), ("rl", 0.9)):
        for c in (True, False):
            plain = _row(result.rows, system, 2, c, tau=tau)
            static = _row(result.rows, system + "+graphs", 2, c)
            assert static["tau"] == tau
            assert (static["mean_output_tokens"], static["nfe_per_sample"]) == (
                plain["mean_output_tokens"],
                plain["nfe_per_sample"],
            )


def test_the_best_ar_speedup_is_paired_with_the_fastest_ar_row() -> None:
    def row(system, tps, drift=(1.0, 0.5, 0.8)):
        rounds = [tps * d for d in drift]
        rate = sorted(rounds)[1]
        where = {"batch_size": 1, "constrained": True}
        return {"system": system, **where, "tokens_per_s_by_round": rounds, "output_tokens_per_s": rate}

    out = add_speedups([row("ar_rl", 10.0), row("ar_rl+pld", 12.5), row("rl", 25.0), row("ar_sft", 99.0)])
    rl = out[2]
    assert rl["best_ar"] == "ar_rl+pld" and rl["speedup_vs_best_ar"] == pytest.approx(2.0)
    assert rl["speedup_vs_ar"] == pytest.approx(2.5)  # ar_sft is another model: never the best AR row


def test_speedups_in_a_run_come_from_the_same_runs_reference_rows(world) -> None:
    tokenizer, prompts, _ = world
    token = tokenizer.convert_tokens_to_ids("<a_3>")
    models = {"ar_rl": forced_model(tokenizer, token), "rl": forced_model(tokenizer, token, block_size=4)}
    rows = _bench(models, tokenizer, prompts, points={"rl": point(0.9, None)}, rounds=3).rows
    for r in rows:
        ref = _row(rows, "ar_rl", r["batch_size"], r["constrained"])
        paired = [
            x / y for x, y in zip(r["tokens_per_s_by_round"], ref["tokens_per_s_by_round"], strict=True)
        ]
        assert r["speedup_vs_ar"] == pytest.approx(sorted(paired)[1])  # the median of the 3 rounds' ratios
        assert (r["speedup_vs_ar_low"], r["speedup_vs_ar_high"]) == pytest.approx((min(paired), max(paired)))
        assert r["output_tokens_per_s"] == pytest.approx(sorted(r["tokens_per_s_by_round"])[1])
        assert r["statistic"] == statistic(3) and len(r["tokens_per_s_by_round"]) == 3
    assert _row(rows, "ar_rl", 4)["speedup_vs_ar"] == 1.0
    assert statistic(3) in format_table(rows) and "1.00 [1.00, 1.00]" in format_table(rows)


def test_every_setting_gets_min_calls_over_the_rounds_counted_by_the_clock(
    world, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer, prompts, _ = world
    token = tokenizer.convert_tokens_to_ids("<a_3>")
    models = {"ar_rl": forced_model(tokenizer, token), "rl": forced_model(tokenizer, token, block_size=4)}
    timed = spy_on_calls(monkeypatch)
    clock = TickingClock()
    config = _config(prompts, min_calls=5, rounds=2, sweep_systems=("rl",))
    decoding = RerankConfig(max_new_tokens=MAX_NEW)
    result = run_benchmark(models, prompts, tokenizer, decoding, config, clock, None, {"rl": point(0.6, 2)})
    # 3 prompts: ceil(max(5, 3) / 2) = 3 calls per round at batch 1, ceil(max(5, 1) / 2) = 3 at batch 4
    assert calls_per_round(1, 3, 2, 5) == calls_per_round(4, 3, 2, 5) == 3
    assert set(result.calls.values()) == {6} and len(result.calls) == len(result.rows)
    assert clock.readings == 2 * sum(result.calls.values())  # every timed call reads the clock twice
    per_round = [(1, 3), (4, 3)] * 3 + [(1, 3)]  # ar_rl, generate, rl at its point; rl's sweep at batch 1
    warmups = [(b, 1) for b, _ in per_round]  # one untimed call each, before the first round
    assert turns(timed) == warmups + per_round * 2  # round after round, every setting in each round
    assert all(r["latency_p50_ms"] == 1000.0 for r in result.rows)
    rows_of_rl = [
        (r["tau"], r["window"], r["operating_point"], r["batch_size"])
        for r in result.rows
        if r["system"] == "rl"
    ]
    assert rows_of_rl == [(0.6, 2, True, 1), (0.6, 2, True, 4), (0.9, None, False, 1)]  # + the sweep


def test_operating_point_candidates_are_timed_interleaved_at_every_batch_size(
    world, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`time_candidates`: each (tau, window) at each batch size, round after round, tokens over seconds."""
    tokenizer, prompts, grammars = world
    token = tokenizer.convert_tokens_to_ids("<a_3>")
    model = forced_model(tokenizer, token, block_size=4)
    timed = spy_on_calls(monkeypatch)
    config = _config(prompts, batch_sizes=(1, 2), rounds=2, min_calls=1)
    clock = TickingClock()
    out = time_candidates(
        model,
        "rl",
        [(0.9, None), (0.6, 2)],
        prompts,
        tokenizer,
        RerankConfig(max_new_tokens=MAX_NEW),
        config,
        grammars,
        clock,
        reference_model=forced_model(tokenizer, token),
    )
    assert set(out) == {(0.9, None), (0.6, 2), None} and all(set(v) == {1, 2} for v in out.values())
    # 3 prompts: 2 calls per round at batch 1 (ceil(3 / 2)), 1 at batch 2; both candidates and the
    # reference (ar_rl, key None) each round, after one warm-up call each
    assert turns(timed) == [(1, 1), (2, 1)] * 3 + [(1, 2), (2, 1)] * 3 * 2
    # every call lasts 1 s on the ticking clock: tokens/s = output tokens per call
    expected = decode(
        model,
        prompts[:1],
        decode_config_for(model, tokenizer, 0.9, RerankConfig(max_new_tokens=MAX_NEW)),
        grammars[:1],
    )
    assert out[(0.9, None)][1] == pytest.approx([len(expected[0].tokens)] * 2)  # per round
    assert out[(0.9, None)][2][0] > out[(0.9, None)][1][0]  # two rows a call: twice the tokens a second
    speed = ranked_speed(out[(0.9, None)], out[None])
    assert speed["tokens_per_s"] == pytest.approx((out[(0.9, None)][1][0] * out[(0.9, None)][2][0]) ** 0.5)
    cand, ref = out[(0.9, None)], out[None]
    per_round = [((cand[1][r] / ref[1][r]) * (cand[2][r] / ref[2][r])) ** 0.5 for r in range(2)]
    assert speed["speedup_vs_ar_rl"] == pytest.approx(sum(per_round) / 2)  # paired, geometric mean, median
    assert speed["statistic"] == statistic(2)
    assert speed["speedup_vs_ar_rl_low"] <= speed["speedup_vs_ar_rl"] <= speed["speedup_vs_ar_rl_high"]
    assert set(speed["speedup_vs_ar_rl_by_batch"]) == {"1", "2"}


def test_a_system_without_an_operating_point_is_timed_unserved_with_a_warning(world, caplog) -> None:
    tokenizer, prompts, _ = world
    token = tokenizer.convert_tokens_to_ids("<a_3>")
    models = {s: forced_model(tokenizer, token, block_size=4) for s in ("cft", "opd", "rl")}
    models["ar_rl"] = forced_model(tokenizer, token)
    points = {
        "cft": refused_operating_point(
            [], 0.5, Policy(choice_margin=0.01), "no (tau, window) reaches R@1 0.490", "ar_rl"
        ),
        "rl": point(0.9, 2),
    }  # opd: no entry at all
    with caplog.at_level(logging.WARNING, logger=bench.__name__):
        rows = _bench(models, tokenizer, prompts, points=points, sweep_systems=("rl", "cft")).rows
    assert {r["system"] for r in rows if r["operating_point"]} == {"ar_rl", GENERATE, "rl"}
    # cft (refused) and opd (absent) at the unserved tau across the batch sizes, never marked served
    unserved = {(r["system"], r["tau"], r["batch_size"]) for r in rows if not r["operating_point"]}
    assert unserved == {("rl", 0.9, 1)} | {(s, 0.9, b) for s in ("cft", "opd") for b in (1, 4)}
    assert "cft" in caplog.text and "R@1 0.490" in caplog.text and "opd" in caplog.text
    no_file = _bench(models, tokenizer, prompts, points=None)  # inference never chose one
    assert {r["system"] for r in no_file.rows if r["operating_point"]} == {"ar_rl", GENERATE}
    assert {r["system"] for r in no_file.rows} == {"ar_rl", GENERATE, "cft", "opd", "rl"}
    skipped = _bench(models, tokenizer, prompts, points=None, unserved_tau=None)
    assert {r["system"] for r in skipped.rows} == {"ar_rl", GENERATE}


def test_plan_times_a_sweep_point_that_is_the_operating_point_once() -> None:
    config = BenchmarkConfig(
        batch_sizes=(1, 4, 16, 32),
        system_batch_sizes={},
        taus=(1.0, 0.9),
        sweep_systems=("rl",),
        sweep_batch_sizes=(1, 16),
        sweep_constrained=(True,),
        prompt_lookup_tokens=None,
    )
    settings = plan_settings(["rl", "ar_rl"], {"rl": point(0.9, None)}, config)
    keys = [s.key for s in settings]
    assert len(keys) == len(set(keys))
    sweep = [(s.tau, s.batch_size) for s in settings if s.system == "rl" and not s.operating_point]
    assert sweep == [(1.0, 1), (1.0, 16)]  # tau 0.9 at batch 1 and 16 is the operating point's row
    assert [(s.system, s.constrained) for s in settings[:8]] == [("ar_rl", True)] * 4 + [("ar_rl", False)] * 4
    assert sum(s.system == GENERATE for s in settings) == 8  # both lines, four batch sizes
    fewer = BenchmarkConfig.from_params(
        {"batch_sizes": [1, 4], "system_batch_sizes": {"cft": [16]}, "taus": [0.9], "sweep_systems": []}
    )
    planned = plan_settings(["ar_rl", "cft"], {"cft": point(0.9, None)}, fewer)
    assert {s.batch_size for s in planned if s.system == "cft"} == {16}
    assert {s.batch_size for s in planned if s.system != "cft"} == {1, 4}


def test_speedup_by_length_compares_each_budget_with_the_reference_under_it() -> None:
    def timed(system, tau, budget, tokens, nfe, seconds):
        setting = TimedSetting(system, tau, None, True, 1, True, budget)
        return setting, [[Call(seconds, [tokens], [nfe])]]  # one round of one call

    rows = speedup_by_length(
        [
            timed("ar_rl", None, None, 100, 100, 5.0),  # the natural budget (the decoding's own: 192)
            timed("ar_rl", None, 64, 60, 60, 3.0),
            timed("rl", 0.9, None, 100, 25, 1.25),
            timed("rl", 0.9, 64, 60, 20, 1.5),
            timed("rl", 0.9, 80, 70, 20, 1.0),  # the reference was not timed at 80
        ],
        natural_budget=192,
    )
    got = {(r["system"], r["budget"]): r for r in rows}
    assert got[("ar_rl", 192)]["speedup"] == 1.0 and got[("ar_rl", 64)]["speedup"] == 1.0
    assert got[("rl", 192)]["speedup"] == pytest.approx(4.0)  # 80 vs 20 tokens/s
    assert got[("rl", 64)]["speedup"] == pytest.approx(2.0)  # 40 vs 20 tokens/s under the same budget
    assert got[("rl", 64)]["tokens_per_forward"] == 3.0 and got[("rl", 64)]["mean_output_tokens"] == 60
    assert got[("rl", 80)]["speedup"] is None and got[("rl", 80)]["speedup_low"] is None
    assert got[("rl", 64)]["speedup_low"] == got[("rl", 64)]["speedup_high"] == pytest.approx(2.0)  # 1 round
    assert got[("rl", 64)]["statistic"] == statistic(1)
    assert [r["system"] for r in rows][:2] == ["ar_rl", "ar_rl"]  # the reference first


def test_length_sweep_times_each_served_line_under_smaller_budgets(world) -> None:
    tokenizer, prompts, _ = world
    token = tokenizer.convert_tokens_to_ids("<a_3>")
    models = {s: forced_model(tokenizer, token, block_size=4) for s in ("cft", "rl")}
    models["ar_rl"] = forced_model(tokenizer, token)
    points = {"rl": point(0.9, 2)}  # cft has none: its unserved line (tau 0.9) stands for it
    config = _config(
        prompts,
        constrained=(True, False),
        sweep_systems=("rl",),
        sweep_constrained=(True,),
        length_budgets=(3, 5),
    )
    lengths = plan_length_settings(plan_settings(list(models), points, config), config)
    lines = [("ar_rl", None, None, True), ("cft", 0.9, None, False), ("rl", 0.9, 2, True)]
    # batch 1 under the grammar only; generate, the free lines and the sweep are not in it
    assert {
        (s.system, s.tau, s.window, s.budget, s.operating_point, s.batch_size, s.constrained) for s in lengths
    } == {(*line[:3], budget, line[3], 1, True) for line in lines for budget in (3, 5)}
    grammars = world[2]
    result = run_benchmark(
        models,
        prompts,
        tokenizer,
        RerankConfig(max_new_tokens=MAX_NEW),
        config,
        TickingClock(),
        grammars,
        operating_points=points,
    )
    got = {(r["system"], r["budget"]): r for r in result.length_rows}
    assert set(got) == {(system, b) for system, *_ in lines for b in (3, 5, MAX_NEW)}  # + the natural budget
    assert all(
        r["mean_output_tokens"] <= r["budget"] for r in result.length_rows
    )  # the budget caps the output
    assert all(got[("ar_rl", b)]["speedup"] == 1.0 for b in (3, 5, MAX_NEW))
    assert all(len(r) == len(result.length_rows[0]) for r in result.length_rows)
    assert all(list(r) == list(BENCHMARK_KEYS) for r in result.rows)  # budgets stay out of benchmark.json
    labels = speedup_by_length_figure(result.length_rows).axes[0].get_legend_handles_labels()[1]
    assert labels == ["cft τ=0.9 not served", "rl τ=0.9 w2", "ar_rl (= 1)"]


def test_speedup_by_batch_plot_and_length_samples_of_a_run(world) -> None:
    tokenizer, prompts, grammars = world
    token = tokenizer.convert_tokens_to_ids("<a_3>")
    models = {"ar_rl": forced_model(tokenizer, token), "rl": forced_model(tokenizer, token, block_size=4)}
    result = _bench(
        models,
        tokenizer,
        prompts,
        {"rl": point(0.9, 2)},
        grammars,
        constrained=(True, False),
        sweep_systems=("rl",),
        sweep_constrained=(True,),
    )
    # batch-1 requests as served (under the grammar): ar_rl, generate, rl at its point, rl's sweep point
    assert len(result.samples) == 4 * len(prompts)
    assert result.length_rows == []  # no length budgets here: no length sweep
    fig = speedup_by_batch_figure(result.rows)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert (
        "rl τ=0.9 w2 (grammar)" in labels and "rl τ=0.9 w2 (free)" in labels and "generate (free)" in labels
    )
    assert not any(label.startswith("rl τ=0.9 (") for label in labels)  # sweep rows belong to the frontier
    # refused: rl is drawn at the tau it was timed at across batch sizes, dotted and "not served"
    unserved = [dict(r, operating_point=False) if r["system"] == "rl" else r for r in result.rows]
    labels = speedup_by_batch_figure(unserved).axes[0].get_legend_handles_labels()[1]
    assert [lb for lb in labels if lb.startswith("rl")] == [
        "rl τ=0.9 w2 (grammar) not served",
        "rl τ=0.9 w2 (free) not served",
    ]  # its widest line (two batch sizes), not the one-point sweep row
