"""A version trained on prompts with evidence serves the same prompts: the spec and the training
sequences travel with it, and a catalogue without the sequences is refused by name."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from transformers import PreTrainedTokenizerFast

from diffusion_gr2.core.model.factory import load_model
from diffusion_gr2.core.serving.serving import Ranker, Request
from diffusion_gr2.core.text.evidence import (
    SIGNALS,
    Evidence,
    EvidenceConfig,
    EvidenceTable,
    LinearRanker,
    evidence_spec,
)
from tests.ops.conftest import World


def _sequences(world: World) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "user_id": world.candidates["user_id"],
            "train_items": [list(h) for h in world.candidates["history"]],
        }
    )


def _ranker(world: World, spec: dict | None, sequences: pd.DataFrame | None) -> Ranker:
    folder = Path(world.models["rl"])
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    config = replace(world.config("rl"), evidence=spec)
    return Ranker(load_model(folder), tokenizer, world.items, world.sids, config, sequences)


def test_served_prompts_show_the_evidence_the_model_was_trained_on(world: World) -> None:
    sequences = _sequences(world)
    config = EvidenceConfig(in_prompt=True, hint=2)
    table = EvidenceTable.from_frames(sequences, world.items, config)
    c = world.candidates
    rows = list(zip(c["user_id"], c["history"], c["candidates"], strict=True))
    s = len(SIGNALS)  # a ranker that adds the signals: the hint names the largest sums
    weights = LinearRanker((0.0,) * s, (1.0,) * s, (1.0,) * s + (0.0,) * (s + 10), 0.0, 10)
    evidence = replace(Evidence.fit(table, rows), ranker=weights)
    ranker = _ranker(world, evidence_spec(evidence), sequences)
    row = world.candidates.iloc[0]
    history, candidates = list(row.history), list(row.candidates)
    request = Request("r0", history, candidates, 0)
    shown = ranker.messages(request)[1]["content"].splitlines()
    lines, hint = shown[-len(candidates) - 1 : -1], shown[-1]
    want = evidence.lines(-1, history, candidates)  # no own sequence at serve time
    assert [line.rsplit(" | ", 1)[1] for line in lines] == want
    assert all(w.startswith("fit ") for w in want)
    sums = table.raw(-1, history, candidates).sum(axis=1)
    best = [ranker.lookup[candidates[k]].sid for k in np.argsort(-sums, kind="stable")[:2]]
    assert hint == "Evidence favours: " + " ".join(best)
    plain = _ranker(world, None, None).messages(request)[1]["content"]
    assert "fit " not in plain  # a version without evidence serves prompts without it


def test_a_catalogue_without_the_training_sequences_is_refused_by_name(world: World) -> None:
    spec = {
        **vars(EvidenceConfig(in_prompt=True)),
        "cuts": {s: [0.5] for s in SIGNALS},
    }
    with pytest.raises(ValueError, match="catalogue has no sequences.parquet"):
        _ranker(world, spec, None)
