"""The answer grammar, and decoding under constraints (AR and block diffusion)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import pandas as pd
import pytest
import torch
from torch import Tensor
from transformers import PreTrainedTokenizerFast

from diffusion_gr2.core.decode.decoder import DecodeConfig, decode
from diffusion_gr2.core.decode.grammar import AnswerGrammar, accepts
from diffusion_gr2.core.decode.grammar_tokens import GrammarTokens, prompt_sids
from diffusion_gr2.core.rank.rerank import request_grammars
from diffusion_gr2.core.text.parser import parse_answer
from diffusion_gr2.core.text.prompt import render_answer
from diffusion_gr2.core.text.tokenizer import IM_END, decode_response
from tests.core.model.tiny import MASK, random_prompts, tiny_model, tiny_model_for
from tests.core.rank.world import make_world


@pytest.fixture(scope="module")
def world() -> Iterator[tuple[PreTrainedTokenizerFast, pd.DataFrame]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield make_world(n_users=4)
    torch.set_num_threads(threads)


def _ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids(IM_END)]


def _walk(grammar: AnswerGrammar, ids: list[int], budget: int = 1000) -> int | None:
    """Feed `ids`; the index of the first token the grammar does not allow, None if all pass."""
    grammar = grammar.copy()
    for n, token in enumerate(ids):
        allowed = grammar.allowed(budget - n)
        if allowed is not None and not bool(allowed[token]):
            return n
        grammar.advance(token)
    return None


def _candidates(requests: pd.DataFrame, row: int = 0) -> list[str]:
    return [str(s) for s in requests["candidate_sids"][row]]


def test_grammar_accepts_every_rendered_answer(world) -> None:
    tokenizer, requests = world
    grammar = request_grammars(tokenizer, requests)[0]
    sids = _candidates(requests)
    for explanation, ranking in [
        ("The user watches dramas, so drama comes first.", sids),
        (f'Cites {sids[2]} and a "quoted" title with a \\ backslash.', sids[::-1]),
        ("", sids[1:] + sids[:1]),
    ]:
        ids = _ids(tokenizer, render_answer(explanation, ranking))
        assert _walk(grammar, ids) is None
        done = grammar.copy()
        for token in ids:
            done.advance(token)
        assert done.phase == "done" and done.allowed(0) is None


@pytest.mark.parametrize("fault", ["foreign", "duplicate", "short", "newline", "structure"])
def test_grammar_rejects_what_the_parser_rejects(world, fault: str) -> None:
    tokenizer, requests = world
    grammar = request_grammars(tokenizer, requests)[0]
    sids, other = _candidates(requests, 0), _candidates(requests, 1)
    foreign = next(s for s in other if s not in sids)
    text = {
        "foreign": render_answer("ok", [foreign, *sids[1:]]),
        "duplicate": render_answer("ok", [sids[0], *sids[:-1]]),
        "short": render_answer("ok", sids[:-1]),
        "newline": render_answer("ok", sids).replace("ok", "o\\nk").replace("\\n", "\n"),
        "structure": render_answer("ok", sids).replace('"recommendations"', '"ranking"'),
    }[fault]
    ids = _ids(tokenizer, text)
    assert not parse_answer(decode_response(tokenizer, ids), sids).valid
    assert _walk(grammar, ids) is not None


def test_tight_budget_closes_the_explanation(world) -> None:
    tokenizer, requests = world
    grammar = request_grammars(tokenizer, requests)[0]
    for token in tokenizer('{"explanation":"', add_special_tokens=False)["input_ids"]:
        grammar.advance(token)  # the opening literal, as the tokenizer writes it
    assert grammar.phase == "text"
    free, tight = grammar.allowed(1000), grammar.allowed(grammar.reserve)
    assert int(tight.sum()) < int(free.sum())
    texts = [tokenizer.decode([i]) for i in tight.nonzero().flatten().tolist()]
    assert texts and all('"' in t for t in texts)  # only tokens that begin the closing literal
    # With the closing literal begun and no room to spare, only its canonical next token is left.
    grammar.advance(
        next(i for i, t in zip(tight.nonzero().flatten().tolist(), texts, strict=True) if t == '"')
    )
    assert int(grammar.allowed(0).sum()) == 1 and int(grammar.allowed(1000).sum()) > 1


def test_grammar_needs_known_and_distinct_sids(world) -> None:
    tokenizer, requests = world
    tokens = GrammarTokens.from_tokenizer(tokenizer, IM_END)
    sids = _candidates(requests)
    with pytest.raises(ValueError, match="duplicate"):
        AnswerGrammar(tokens, [sids[0], sids[0]])
    with pytest.raises(ValueError, match="not in the tokenizer"):
        AnswerGrammar(tokens, ["<a_9999><b_1><c_1><d_1>"])


@pytest.mark.parametrize(("k", "tau"), [(1, 0.9), (4, 0.9), (4, 0.3), (8, 0.5)])
def test_constrained_decoding_always_gives_a_valid_ranking(world, k: int, tau: float) -> None:
    tokenizer, requests = world
    model = tiny_model_for(tokenizer, None if k == 1 else k)
    cfg = DecodeConfig(
        block_size=k,
        threshold=tau,
        max_new_tokens=96,
        mask_token_id=tokenizer.mask_token_id if k > 1 else None,
        eos_token_ids=(tokenizer.convert_tokens_to_ids(IM_END),),
        batch_size=3,  # rows of one batch end at different times
    )
    prompts = [list(p) for p in requests["prompt_ids"]]
    grammars = request_grammars(tokenizer, requests)
    outputs = decode(model, prompts, cfg, grammars)
    for row, out in enumerate(outputs):
        assert parse_answer(decode_response(tokenizer, out.tokens), _candidates(requests, row)).valid
        assert out.forced > 0  # a random model never writes a valid answer on its own
        assert all(lp <= 1e-6 for lp in out.token_logprobs)
    if k > 1:  # the grammar reads committed tokens only, so the KV cache stays exact
        again = decode(model, prompts, dataclasses.replace(cfg, recompute=True), grammars)
        assert [o.tokens for o in again] == [o.tokens for o in outputs]
    assert grammars[0].phase == "literal"  # the caller's grammars are copied, never advanced


class _Ban:
    """A test constraint: token `banned` is not allowed at output position `at`."""

    def __init__(self, banned: int, at: int, vocab: int) -> None:
        self.banned, self.at, self.vocab, self.n = banned, at, vocab, 0

    def allowed(self, budget: int) -> Tensor | None:
        if self.n != self.at:
            return None
        mask = torch.ones(self.vocab, dtype=torch.bool)
        mask[self.banned] = False
        return mask

    def advance(self, token: int) -> None:
        self.n += 1

    def only(self, budget: int) -> int | None:
        return None  # never a single choice: nothing to jump over

    def copy(self) -> _Ban:
        clone = _Ban(self.banned, self.at, self.vocab)
        clone.n = self.n
        return clone


@pytest.mark.parametrize(("k", "tau"), [(1, 0.9), (4, 0.5), (8, 0.3)])
def test_a_constraint_changes_only_what_it_forbids(k: int, tau: float) -> None:
    model, prompts = tiny_model(), random_prompts([7, 12, 3])
    cfg = DecodeConfig(block_size=k, threshold=tau, max_new_tokens=20, mask_token_id=MASK if k > 1 else None)
    free = decode(model, prompts, cfg)
    vocab = model.config.vocab_size
    allow_all = decode(model, prompts, cfg, [_Ban(-1, -1, vocab) for _ in prompts])
    assert [o.tokens for o in allow_all] == [o.tokens for o in free]
    assert all(o.forced == 0 for o in allow_all)
    at = 5
    banned = decode(model, prompts, cfg, [_Ban(o.tokens[at], at, vocab) for o in free])
    for a, b in zip(free, banned, strict=True):
        assert b.tokens[:at] == a.tokens[:at] and b.tokens[at] != a.tokens[at]
        # AR replaces the token once; diffusion may first cut a run there, then replace it
        assert b.forced == 1 if k == 1 else b.forced >= 1


def test_constraints_need_the_prefix_rule() -> None:
    model, prompts = tiny_model(), random_prompts([5])
    cfg = DecodeConfig(block_size=4, mask_token_id=MASK, commit_rule="confident")
    with pytest.raises(ValueError, match="prefix"):
        decode(model, prompts, cfg, [_Ban(3, 0, model.config.vocab_size)])


def test_only_names_the_single_allowed_token(world) -> None:
    """`only` (the jump-forward fast path) never claims a choice the mask does not force, and finds
    every forced SID and end token; budgets from generous to tight."""
    tokenizer, requests = world
    grammar = request_grammars(tokenizer, requests)[0]
    sids = _candidates(requests)
    ids = _ids(tokenizer, render_answer(f"Pick {sids[3]} first.", sids[3:] + sids[:3]))
    for slack in (1000, 0):
        state, forced = grammar.copy(), 0
        for n, token in enumerate(ids):
            budget = len(ids) - n + slack
            allowed, only = state.allowed(budget), state.only(budget)
            singleton = allowed is not None and int(allowed.sum()) == 1
            if only is not None:
                assert singleton and bool(allowed[only]) and only == token
                forced += 1
            elif state.phase in ("sid", "eos"):
                assert not singleton
            state.advance(token)
        # the last SID (all its tokens) and the end token at least; more where prefixes pin SIDs
        assert forced >= grammar.sid_length + 1


@pytest.mark.parametrize("batch_size", [1, 3])
def test_ar_jump_forward_is_exact(world, batch_size: int) -> None:
    """AR jump-forward writes forced tokens without a forward, and changes nothing else: the same
    tokens, corrections and log-probs as one forward per token (the skipped predictions are checked
    in the next forward)."""
    tokenizer, requests = world
    model = tiny_model_for(tokenizer, num_layers=2)  # a chunk's causal mask shows in layer 2's keys
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    cfg = DecodeConfig(max_new_tokens=96, eos_token_ids=(eos,), batch_size=batch_size)
    prompts = [list(p) for p in requests["prompt_ids"]]
    grammars = request_grammars(tokenizer, requests)
    plain = decode(model, prompts, dataclasses.replace(cfg, jump_forward=False), grammars)
    jumped = decode(model, prompts, cfg, grammars)
    assert [o.tokens for o in jumped] == [o.tokens for o in plain]
    assert [o.forced for o in jumped] == [o.forced for o in plain]
    for a, b in zip(jumped, plain, strict=True):
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-5)
    assert sum(o.nfe for o in jumped) < sum(o.nfe for o in plain)
    if batch_size == 1:  # alone, a row skips every forced token but its end token
        for o in jumped:
            assert o.nfe < len(o.tokens)


@pytest.mark.parametrize("k", [4, 8])
def test_diffusion_jump_forward_commits_forced_positions_as_certain(world, k: int) -> None:
    tokenizer, requests = world
    model = tiny_model_for(tokenizer, k)
    cfg = DecodeConfig(
        block_size=k,
        threshold=0.9,
        max_new_tokens=96,
        mask_token_id=tokenizer.mask_token_id,
        eos_token_ids=(tokenizer.convert_tokens_to_ids(IM_END),),
        batch_size=3,
    )
    prompts = [list(p) for p in requests["prompt_ids"]]
    grammars = request_grammars(tokenizer, requests)
    plain = decode(model, prompts, dataclasses.replace(cfg, jump_forward=False), grammars)
    jumped = decode(model, prompts, cfg, grammars)
    for row, out in enumerate(jumped):
        assert parse_answer(decode_response(tokenizer, out.tokens), _candidates(requests, row)).valid
        state = grammars[row].copy()  # every forced position holds its token, at log-prob 0
        for n, (token, logp) in enumerate(zip(out.tokens, out.token_logprobs, strict=True)):
            if state.only(cfg.max_new_tokens - n) is not None:
                assert logp == 0.0
            state.advance(token)
    tokens = sum(len(o.tokens) for o in jumped)
    assert tokens / sum(o.nfe for o in jumped) > sum(len(o.tokens) for o in plain) / sum(o.nfe for o in plain)
    again = decode(model, prompts, dataclasses.replace(cfg, recompute=True), grammars)
    assert [o.tokens for o in again] == [o.tokens for o in jumped]  # the KV cache stays exact


@pytest.mark.parametrize("k", [1, 4])
def test_accepts_is_what_constrained_decoding_leaves_untouched(k: int) -> None:
    """A free output the constraint accepts is exactly what constrained decoding (no jump-forward)
    writes with no correction, and one it rejects is corrected: the model's own valid rate can be
    read off a free pass when the served pass jumps."""
    model, prompts = tiny_model(), random_prompts([7, 12])
    cfg = DecodeConfig(
        block_size=k,
        threshold=0.5,
        max_new_tokens=20,
        mask_token_id=MASK if k > 1 else None,
        jump_forward=False,
    )
    vocab = model.config.vocab_size
    free = decode(model, prompts, cfg)
    for at in (0, 5):
        for hit in (True, False):
            bans = [_Ban(o.tokens[at] if hit else (o.tokens[at] + 1) % vocab, at, vocab) for o in free]
            constrained = decode(model, prompts, cfg, bans)
            for out, ban, again in zip(free, bans, constrained, strict=True):
                assert accepts(ban, out.tokens, cfg.max_new_tokens) is not hit
                assert (again.forced == 0) is not hit
                if not hit:
                    assert again.tokens == out.tokens


def test_cited_sids_are_the_prompts_and_their_rest_is_forced(world) -> None:
    """`cite_prompt_sids`: an explanation citing the prompt's SIDs (history or candidates) is
    accepted, one citing any other SID (or part of one) is not; once a citation's first tokens pin
    a SID, `only` names the rest; without the option anything goes, as before."""
    tokenizer, requests = world
    plain, cited = request_grammars(tokenizer, requests)[0], request_grammars(tokenizer, requests, True)[0]
    tokens = plain.tokens
    sids = _candidates(requests)
    prompt = list(requests["prompt_ids"][0])
    in_prompt = prompt_sids(tokens, prompt, plain.sid_length)
    history = [s for s in in_prompt if s not in {tokens.sid_ids_of(c) for c in sids}]
    assert history and len(in_prompt) == len(sids) + len(history)  # the world's prompts show both
    history_text = tokenizer.decode(list(history[0]))
    good = _ids(tokenizer, render_answer(f"latest {history_text} then {sids[2]}.", sids))
    assert _walk(cited, good) is None and _walk(plain, good) is None
    # a candidate's SID with another last level: SID tokens that exist, a SID the prompt lacks
    head = sids[0][: sids[0].rindex("<")]
    foreign = next(
        head + t
        for t in sorted(tokens.vocab)
        if t.startswith("<d_") and tokens.sid_ids_of(head + t) not in in_prompt
    )
    for bad in (f"cites {foreign} here", f"cites {sids[1][: sids[1].index('><') + 1]} alone"):
        ids = _ids(tokenizer, render_answer(bad, sids))
        assert _walk(plain, ids) is None and _walk(cited, ids) is not None
        assert not accepts(cited, ids, 1000) and accepts(plain, ids, 1000)
    state, forced = cited.copy(), 0
    for token in good:
        only = state.only(1000)
        if only is not None and state.phase == "text":
            assert only == token and int(state.allowed(1000).sum()) == 1
            forced += 1
        state.advance(token)
    assert forced >= 2  # at least the last token of each of the two citations


def test_cited_sids_keep_ar_jump_forward_exact_and_every_answer_valid(world) -> None:
    """Decoding under the stricter grammar, by a model drawn to SID tokens (it cites often): every
    answer valid, citations of the prompt's SIDs only, AR jump-forward still exact, and more tokens
    written without a forward than under the plain grammar (the rest of each pinned citation)."""
    tokenizer, requests = world
    model = tiny_model_for(tokenizer, num_layers=2)
    head = model.get_output_embeddings()
    sid_tokens = GrammarTokens.from_tokenizer(tokenizer, IM_END).sid_tokens
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.copy_(sid_tokens.float() * 3.0)  # SID tokens: most of the arg-max
    model.set_output_embeddings(biased.to(head.weight.device))
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    cfg = DecodeConfig(max_new_tokens=96, eos_token_ids=(eos,), batch_size=1)
    prompts = [list(p) for p in requests["prompt_ids"]]
    grammars = request_grammars(tokenizer, requests, True)
    plain = decode(model, prompts, dataclasses.replace(cfg, jump_forward=False), grammars)
    jumped = decode(model, prompts, cfg, grammars)
    assert [o.tokens for o in jumped] == [o.tokens for o in plain]
    assert [o.forced for o in jumped] == [o.forced for o in plain]
    loose = decode(model, prompts, cfg, request_grammars(tokenizer, requests))
    citations = 0
    for row, out in enumerate(jumped):
        text = decode_response(tokenizer, out.tokens)
        assert parse_answer(text, _candidates(requests, row)).valid and accepts(grammars[row], out.tokens, 96)
        explanation = text.split('","recommendations"')[0]
        cited = {
            tuple(tokenizer(s, add_special_tokens=False)["input_ids"])
            for s in re.findall(r"(?:<[a-z]_\d+>){4}", explanation)
        }
        assert cited <= prompt_sids(grammars[row].tokens, prompts[row], grammars[row].sid_length)
        citations += len(cited)
    assert citations >= len(prompts)  # the case is real: the explanations cite
    jumps = [len(o.tokens) - o.nfe for o in jumped]
    assert sum(jumps) > sum(len(o.tokens) - o.nfe for o in loose)
