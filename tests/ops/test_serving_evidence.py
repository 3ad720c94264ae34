"""A version trained on prompts with evidence serves the same prompts: the spec and the training
sequences travel with it, and a catalogue without the sequences is refused by name."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
from transformers import PreTrainedTokenizerFast

from diffusion_gr2.core.model.factory import load_model
from diffusion_gr2.core.serving.serving import Ranker, Request
from diffusion_gr2.core.text.evidence import Evidence, EvidenceConfig, EvidenceTable, evidence_spec
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
    config = EvidenceConfig(in_prompt=True)
    table = EvidenceTable.from_frames(sequences, world.items, config)
    c = world.candidates
    rows = list(zip(c["user_id"], c["history"], c["candidates"], strict=True))
    evidence = Evidence.fit(table, rows)
    ranker = _ranker(world, evidence_spec(evidence), sequences)
    row = world.candidates.iloc[0]
    request = Request("r0", list(row.history), list(row.candidates), 0)
    lines = ranker.messages(request)[1]["content"].splitlines()[-len(row.candidates) :]
    want = evidence.lines(-1, list(row.history), list(row.candidates))  # no own sequence at serve time
    assert [line.rsplit(" | ", 1)[1] for line in lines] == want
    assert all(w.startswith("fit ") for w in want)
    plain = _ranker(world, None, None).messages(request)[1]["content"]
    assert "fit " not in plain  # a version without evidence serves prompts without it


def test_a_catalogue_without_the_training_sequences_is_refused_by_name(world: World) -> None:
    spec = {
        **vars(EvidenceConfig(in_prompt=True)),
        "cuts": {s: [0.5] for s in ("fit", "year", "after", "pop")},
    }
    with pytest.raises(ValueError, match="catalogue has no sequences.parquet"):
        _ranker(world, spec, None)
