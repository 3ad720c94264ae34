"""Decode benchmark: rows, output-token accounting, batching, speed-up by output length."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import pandas as pd
import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.decode.decoder import decode
from diffusion_gr2.core.rank import benchmark as bench
from diffusion_gr2.core.rank.benchmark import (
    BENCHMARK_KEYS,
    BenchmarkConfig,
    format_table,
    full_batches,
    run_benchmark,
    speedup_by_length,
)
from diffusion_gr2.core.rank.plots import speedup_figure
from diffusion_gr2.core.rank.rerank import RerankConfig, decode_config_for
from diffusion_gr2.core.text.tokenizer import IM_END
from tests.core.model.tiny import tiny_model_for
from tests.core.rank.world import make_world

MAX_NEW = 8


@pytest.fixture(scope="module")
def world() -> Iterator[tuple[PreTrainedTokenizerFast, list[list[int]]]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only add contention
    tokenizer, requests = make_world(n_users=3)
    yield tokenizer, [list(p) for p in requests["prompt_ids"]]
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


def ticking_clock() -> Callable[[], float]:
    """A fake clock that advances one second per reading: every timed call lasts exactly 1 s."""
    counter = itertools.count()
    return lambda: float(next(counter))


def _bench(models: dict[str, PreTrainedModel], tokenizer, prompts, batch_sizes=(1, 4), taus=(0.9,)):
    config = BenchmarkConfig(n_prompts=len(prompts), batch_sizes=batch_sizes, taus=taus, warmup=1)
    decoding = RerankConfig(max_new_tokens=MAX_NEW, constrained=False)  # forced models: raw speed
    return run_benchmark(models, prompts, tokenizer, decoding, config, clock=ticking_clock())


def test_throughput_counts_output_tokens_only(world) -> None:
    tokenizer, prompts = world  # prompts are ~460 tokens: counting them would dwarf the output
    never_ends = forced_model(tokenizer, tokenizer.convert_tokens_to_ids("<a_3>"))
    stops_at_once = forced_model(tokenizer, tokenizer.convert_tokens_to_ids(IM_END))
    long = {(r["batch_size"]): r for r in _bench({"ar_rl": never_ends}, tokenizer, prompts).rows}
    assert (
        long[1]["mean_output_tokens"] == MAX_NEW and long[1]["output_tokens_per_s"] == MAX_NEW
    )  # 3 calls, 3 s
    assert long[1]["latency_p50_ms"] == long[1]["latency_p95_ms"] == 1000.0  # per request at batch 1
    # batch 4 cycles the 3 prompts into one full batch: 4 rows x 8 tokens in one 1-s call.
    assert long[4]["output_tokens_per_s"] == 4 * MAX_NEW and long[4]["latency_p50_ms"] == 1000.0
    assert long[1]["nfe_per_sample"] == MAX_NEW and long[1]["tokens_per_forward"] == 1.0
    (short, _) = _bench({"ar_rl": stops_at_once}, tokenizer, prompts).rows
    assert short["mean_output_tokens"] == 1 and short["output_tokens_per_s"] == 1.0  # the end token only


def test_rows_have_every_key_and_diffusion_commits_several_tokens_per_forward(world) -> None:
    tokenizer, prompts = world
    token = tokenizer.convert_tokens_to_ids("<a_3>")
    models = {"cft": forced_model(tokenizer, token, block_size=4), "ar_rl": forced_model(tokenizer, token)}
    result = _bench(models, tokenizer, prompts, taus=(0.9, 0.6))
    assert all(list(r) == list(BENCHMARK_KEYS) for r in result.rows)
    settings = [(r["system"], r["tau"], r["batch_size"]) for r in result.rows]
    assert settings == [("ar_rl", None, 1), ("ar_rl", None, 4)] + [
        ("cft", t, b) for t in (0.9, 0.6) for b in (1, 4)
    ]  # the reference first, AR once, diffusion per tau
    assert all(r["device"].startswith("cpu") for r in result.rows)
    cft = next(r for r in result.rows if r["system"] == "cft")
    cfg = decode_config_for(models["cft"], tokenizer, 0.9, RerankConfig(max_new_tokens=MAX_NEW))
    direct = decode(models["cft"], prompts, cfg)
    assert cft["nfe_per_sample"] == sum(o.nfe for o in direct) / len(direct)
    assert cft["tokens_per_forward"] > 1.5  # confident model: a 4-token block in one step + one commit
    assert cft["output_tokens_per_s"] == MAX_NEW  # fake clock: same tokens per 1-s call as AR
    assert len(result.samples) == 3 * len(prompts)  # batch-1 requests of ar_rl, cft@0.9, cft@0.6
    assert "cft" in format_table(result.rows) and "tok/s" in format_table(result.rows)


def test_rounds_interleave_the_settings_and_pool_their_calls(world, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer, prompts = world
    token = tokenizer.convert_tokens_to_ids("<a_3>")
    models = {"cft": forced_model(tokenizer, token, block_size=4), "ar_rl": forced_model(tokenizer, token)}
    timed: list[tuple[int, int]] = []  # (block size, batch size) of each timed setting, in order
    real = bench.time_calls

    def spy(model, batches, config, *args, **kwargs):
        timed.append((config.block_size, len(batches[0])))
        return real(model, batches, config, *args, **kwargs)

    monkeypatch.setattr(bench, "time_calls", spy)
    config = BenchmarkConfig(n_prompts=len(prompts), batch_sizes=(1, 4), taus=(0.9,), warmup=0, rounds=2)
    decoding = RerankConfig(max_new_tokens=MAX_NEW, constrained=False)
    result = run_benchmark(models, prompts, tokenizer, decoding, config, clock=ticking_clock())
    assert timed == [(1, 1), (1, 4), (4, 1), (4, 4)] * 2  # round after round, not setting after setting
    assert len(result.rows) == 4 and len(result.samples) == 2 * 2 * len(prompts)  # both rounds pooled
    ar_b1 = next(r for r in result.rows if r["system"] == "ar_rl" and r["batch_size"] == 1)
    assert ar_b1["output_tokens_per_s"] == MAX_NEW  # 6 calls of 1 s, 8 tokens each


def test_speedup_by_length_buckets_and_ratios() -> None:
    samples = pd.DataFrame(
        [
            {"system": "ar_rl", "tau": float("nan"), "output_tokens": 20, "nfe": 20, "latency_s": 1.0},
            {"system": "ar_rl", "tau": float("nan"), "output_tokens": 100, "nfe": 100, "latency_s": 5.0},
            {"system": "rl", "tau": 0.9, "output_tokens": 20, "nfe": 10, "latency_s": 0.5},
            {"system": "rl", "tau": 0.9, "output_tokens": 100, "nfe": 25, "latency_s": 1.25},
            {"system": "rl", "tau": 0.9, "output_tokens": 300, "nfe": 60, "latency_s": 3.0},
        ]
    )
    rows = speedup_by_length(samples, edges=(32, 64, 128, 256))
    got = {(r["system"], r["bucket"]): r for r in rows}
    assert got[("ar_rl", "1-32")]["speedup"] == 1.0 and got[("ar_rl", "1-32")]["tau"] is None
    assert got[("rl", "1-32")]["speedup"] == pytest.approx(2.0)
    assert got[("rl", "65-128")]["speedup"] == pytest.approx(4.0)  # 80 vs 20 tokens/s
    assert got[("rl", "65-128")]["tokens_per_forward"] == 4.0 and got[("rl", "65-128")]["tau"] == 0.9
    assert got[("rl", ">256")]["speedup"] is None  # the reference never wrote that much
    speedup_figure(rows)  # renders without error, reference and None speed-ups skipped


def test_full_batches_cycle_prompts_to_fill_every_batch() -> None:
    prompts = [[1], [2], [3]]
    assert full_batches(prompts, 1) == [[[1]], [[2]], [[3]]]
    assert full_batches(prompts, 2) == [[[1], [2]], [[3], [1]]]
    assert full_batches(prompts, 16) == [[[1], [2], [3]] * 5 + [[1]]]
    with pytest.raises(ValueError):
        full_batches([], 4)
