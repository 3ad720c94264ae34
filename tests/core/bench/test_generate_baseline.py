"""`generate` baseline: the same tokens as our AR decoder, free and under each request's grammar."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.bench.generate_baseline import generate_tokens
from diffusion_gr2.core.decode.decoder import decode
from diffusion_gr2.core.decode.grammar import AnswerGrammar
from diffusion_gr2.core.rank.rerank import RerankConfig, decode_config_for, request_grammars
from tests.core.model.tiny import tiny_model_for
from tests.core.rank.world import make_world

MAX_NEW = 72  # room for a short explanation and the 10-SID answer; the grammar closes it in time


@pytest.fixture(scope="module")
def world() -> Iterator[
    tuple[PreTrainedTokenizerFast, PreTrainedModel, list[list[int]], list[AnswerGrammar]]
]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tokenizer, requests = make_world(n_users=3)
    prompts = [list(p) for p in requests["prompt_ids"]]
    prompts[1] = prompts[1][5:]  # rows of different lengths: generate left-pads as our decoder does
    yield tokenizer, tiny_model_for(tokenizer), prompts, request_grammars(tokenizer, requests)
    torch.set_num_threads(threads)


def test_generate_equals_our_ar_decoder_free(world) -> None:
    tokenizer, model, prompts, _ = world
    cfg = decode_config_for(model, tokenizer, None, RerankConfig(max_new_tokens=16, batch_size=3))
    ours = decode(model, prompts, cfg)
    assert generate_tokens(model, prompts, cfg) == [o.tokens for o in ours]


def test_grammar_logits_processor_gives_our_constrained_ar_decoders_tokens(world) -> None:
    tokenizer, model, prompts, grammars = world
    cfg = decode_config_for(model, tokenizer, None, RerankConfig(max_new_tokens=MAX_NEW, batch_size=2))
    ours = decode(model, prompts, cfg, grammars)
    assert all(o.forced > 0 for o in ours)  # random weights: the grammar really corrects them
    got = generate_tokens(model, prompts, cfg, grammars)
    assert got == [o.tokens for o in ours]
    assert all(t[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>") for t in got)  # complete answers
    again = generate_tokens(model, prompts, cfg, grammars)  # the caller's grammars were not consumed
    assert again == got
