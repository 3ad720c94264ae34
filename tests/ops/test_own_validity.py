"""One definition of the model's own valid rate: stage metrics, the gate and a served answer agree.

`unforced` (the model's answer decoded without the grammar is one the grammar accepts) is computed by
`rerank.own_validity` wherever it is reported. Here a random tiny diffusion model serves under the
grammar (every served answer valid); its free pass is replaced by canned answers, valid for every
other request, so the own rate is neither 0 nor 1 and each path must read the same free answers.
"""

from __future__ import annotations

import pandas as pd
import pytest

from diffusion_gr2.core.decode.decoder import DecodeOutput
from diffusion_gr2.core.decode.grammar import answer_grammars
from diffusion_gr2.core.evaluate.rankings import stage_metrics
from diffusion_gr2.core.rank import rerank as rerank_module
from diffusion_gr2.core.rank.rerank import rerank
from diffusion_gr2.core.registry.gate import score
from diffusion_gr2.core.serving.serving import Ranker
from diffusion_gr2.core.text.prompt import build_messages, render_answer
from diffusion_gr2.core.text.tokenizer import IM_END, encode_prompt
from tests.ops.conftest import World

LONG = {"max_new_tokens": 96}


def test_stage_metrics_the_gate_and_served_answers_report_the_same_own_validity(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    ranker = Ranker.from_dir(world.models["rl"], _catalogue(world), world.config("rl", **LONG))
    rows = world.candidates
    prompts = [
        encode_prompt(ranker.tokenizer, build_messages(list(h), list(c), ranker.lookup, ranker.prompt))
        for h, c in zip(rows["history"], rows["candidates"], strict=True)
    ]
    sid_lists = [ranker.lookup.sids(list(c)) for c in rows["candidates"]]
    end = ranker.tokenizer.convert_tokens_to_ids(IM_END)
    canned = {}
    for n, (prompt, sids) in enumerate(zip(prompts, sid_lists, strict=True)):
        text = render_answer("own words", sids[::-1] if n % 2 == 0 else sids[:-1])  # odd: one SID short
        canned[tuple(prompt)] = DecodeOutput(
            ranker.tokenizer(text, add_special_tokens=False)["input_ids"] + [end], [], 1, []
        )
    real = rerank_module.decode_requests

    def free_pass_canned(model, prompts, config, desc="decode", grammars=None):  # noqa: ANN001, ANN202
        if grammars is None:  # the free pass: the canned answers
            return [canned[tuple(p)] for p in prompts]
        return real(model, prompts, config, desc, grammars)

    monkeypatch.setattr(rerank_module, "decode_requests", free_pass_canned)
    expected = [n % 2 == 0 for n in range(len(rows))]

    # inference: rankings rows, then stage_metrics.json's figure
    requests = rows.assign(prompt_ids=prompts, candidate_sids=sid_lists)
    grammars = answer_grammars(ranker.tokenizer, sid_lists, IM_END)
    ranked = rerank(ranker.model, requests, ranker.tokenizer, ranker.decode, "rl", 0.9, grammars)
    assert ranked["valid"].all() and ranked["unforced"].tolist() == expected
    (metrics,) = stage_metrics(ranked, n_boot=10)

    # serving: each answer's field, asked for
    records = [
        {"request_id": str(n), "history": world.raw(h), "candidates": world.raw(c)}
        for n, (h, c) in enumerate(zip(rows["history"], rows["candidates"], strict=True))
    ]
    served = ranker.rank(ranker.parse(records), own_valid=True)
    assert [a["unforced"] for a in served] == expected
    assert all(a["unforced"] is None for a in ranker.rank(ranker.parse(records)))  # not asked: unknown

    # the gate
    gate = score(ranker, pd.DataFrame(records).assign(target=[world.raw([t])[0] for t in rows["target"]]))
    assert metrics["unforced_rate"] == gate["unforced_rate"] == sum(expected) / len(expected) == 0.5


def _catalogue(world: World):  # noqa: ANN202
    folder = world.models["rl"].parent / "catalogue"
    folder.mkdir(exist_ok=True)
    world.items.to_parquet(folder / "items.parquet")
    world.sids.to_parquet(folder / "sids.parquet")
    return folder
