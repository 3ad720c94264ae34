"""Prompt lookup: the n-gram index against a plain loop, and drafted AR decoding against plain AR."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Sequence

import pandas as pd
import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.decode import runner as decode_runner
from diffusion_gr2.core.decode.decoder import DecodeConfig, DecodeOutput, decode
from diffusion_gr2.core.decode.draft import MAX_NGRAM, PromptLookup
from diffusion_gr2.core.rank.rerank import request_grammars
from diffusion_gr2.core.text.tokenizer import IM_END
from tests.core.model.tiny import MASK, VOCAB, random_prompts, tiny_model, tiny_model_for
from tests.core.rank.world import make_world

SEP, COPY = 3, 10  # the copy model answers `[x | SEP]`, x of COPY tokens, with x


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models: more threads only add contention (the copier trains 10x slower on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def world(one_thread: None) -> tuple[PreTrainedTokenizerFast, pd.DataFrame]:
    """16 requests (batch 16 is one full batch) of the smoke-style world."""
    return make_world(n_users=16)


@pytest.fixture(scope="module")
def copier(one_thread: None) -> PreTrainedModel:
    """A tiny model trained (120 steps, ~3 s on one core) to answer `[x | SEP]` with x, x of `COPY`
    tokens: a model that copies its prompt, where prompt lookup must pay. (A fixed length lets it
    learn to copy by position, which 120 steps do; copying any length takes far longer to learn.)"""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tiny_model(head_scale=1.0).train()
        gen = torch.Generator().manual_seed(0)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(120):
            x = torch.randint(SEP + 1, VOCAB, (32, COPY), generator=gen)
            seq = torch.cat([x, torch.full((32, 1), SEP), x], 1).to(model.device)  # [b, 2 COPY + 1]
            labels = seq.masked_fill(torch.arange(seq.shape[1], device=seq.device) <= COPY, -100)
            loss = model(input_ids=seq, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


def _reference(tokens: Sequence[int], extra: Sequence[int], m: int) -> list[int]:
    """Prompt-lookup decoding's draft as `transformers` computes it: for n = 3, 2, 1, scan every
    window of `tokens` for the last n tokens of `tokens + extra`; the first window with a non-empty
    continuation wins."""
    tail = [*tokens, *extra]
    for n in range(min(MAX_NGRAM, len(tail)), 0, -1):
        for start in range(len(tokens) - n + 1):
            if list(tokens[start : start + n]) == tail[-n:] and start + n < len(tokens):
                return list(tokens[start + n : start + n + m])
    return []


def test_prompt_lookup_is_the_plain_scan() -> None:
    """The incremental index drafts what a scan of the whole sequence drafts, with and without a
    draft under construction (`extra`); hand-checked cases first."""
    lookup = PromptLookup([5, 6, 7, 8, 6, 7])
    assert lookup.draft([], 3) == [8, 6, 7]  # "6 7" first occurs at 1: what followed it
    assert lookup.draft([9], 3) == []  # 9 occurs nowhere
    assert lookup.draft([8], 2) == [6, 7]  # "7 8" (with the draft) occurred at 2
    lookup.extend([5])
    assert lookup.draft([], 10) == [6, 7, 8, 6, 7, 5]  # "7 5" is new, "5" first occurred at 0
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        tokens = torch.randint(
            0, 4, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen
        ).tolist()
        cut, split = (int(torch.randint(1, len(tokens) + 1, (1,), generator=gen)) for _ in range(2))
        lookup = PromptLookup(tokens[: min(split, cut)])  # a prompt, then written tokens
        lookup.extend(tokens[min(split, cut) : cut])
        assert lookup.draft(tokens[cut:], 5) == _reference(tokens[:cut], tokens[cut:], 5)


def _same(drafted: list[DecodeOutput], plain: list[DecodeOutput]) -> None:
    """Token for token the same outputs, corrections and log-probs (to float noise)."""
    for a, b in zip(drafted, plain, strict=True):
        assert (a.tokens, a.commit_steps, a.forced, a.tail_tokens) == (b.tokens, b.commit_steps, b.forced, [])
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-5)


def _plain_case(  # type: ignore[no-untyped-def]
    world, batch_size: int, constrained: bool, jump_forward: bool, monkeypatch, n: int = 16
):
    """A two-layer model (a wrong mask or position shows), the world's first `n` prompts, its plain
    AR decode, and a list that counts the holes drafted decoding leaves from here on."""
    tokenizer, requests = world
    requests = requests.iloc[:n]
    model = tiny_model_for(tokenizer, num_layers=2)
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    cfg = DecodeConfig(
        max_new_tokens=96, eos_token_ids=(eos,), batch_size=batch_size, jump_forward=jump_forward
    )
    prompts = [list(p) for p in requests["prompt_ids"]]
    grammars = request_grammars(tokenizer, requests) if constrained else None
    plain = decode(model, prompts, cfg, grammars)
    holes: list[int] = []
    with_holes = decode_runner.with_holes

    def counted(layout, end, rows):  # type: ignore[no-untyped-def]
        holes.append(sum(rows))
        return with_holes(layout, end, rows)

    monkeypatch.setattr(decode_runner, "with_holes", counted)
    return tokenizer, model, cfg, prompts, grammars, plain, holes


@pytest.mark.parametrize("batch_size", [1, 16])
@pytest.mark.parametrize(("constrained", "jump_forward"), [(True, True), (True, False), (False, True)])
def test_prompt_lookup_is_exact(
    world, batch_size: int, constrained: bool, jump_forward: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every prompt of the world: drafted AR decoding writes plain AR decoding's tokens, log-probs
    and corrections, free and under the answer grammar (with and without jump-forward), alone and
    16 rows at once (rows that keep different drafts leave holes: counted, so the case is real)."""
    tokenizer, model, cfg, prompts, grammars, plain, holes = _plain_case(
        world, batch_size, constrained, jump_forward, monkeypatch
    )
    for k in (1, 3, 10):
        drafted = decode(model, prompts, dataclasses.replace(cfg, draft="prompt", draft_tokens=k), grammars)
        _same(drafted, plain)
        if batch_size == 1:  # alone, a forward writes at least the token a plain forward writes
            assert all(a.nfe <= b.nfe for a, b in zip(drafted, plain, strict=True))
    assert (sum(holes) > 0) == (batch_size > 1)


def test_drafted_recompute_equals_cached(world) -> None:
    """The debugging runner (no cache, whole sequence re-run) with its holes decodes the same."""
    tokenizer, requests = world
    model = tiny_model_for(tokenizer, num_layers=2)
    cfg = DecodeConfig(
        max_new_tokens=64,
        eos_token_ids=(tokenizer.convert_tokens_to_ids(IM_END),),
        draft="prompt",
        draft_tokens=4,
    )
    prompts = [list(p) for p in requests["prompt_ids"]][:6]
    grammars = request_grammars(tokenizer, requests)[:6]
    cached = decode(model, prompts, cfg, grammars)
    _same(decode(model, prompts, dataclasses.replace(cfg, recompute=True), grammars), cached)


@pytest.mark.parametrize("batch_size", [1, 16])
def test_prompt_lookup_cuts_the_forwards_of_a_model_that_copies(
    copier: PreTrainedModel, batch_size: int
) -> None:
    """A model that copies its prompt: the same tokens in 2 forwards instead of 10 (the prefill
    writes x's first token; its unigram then finds the rest in the prompt, verified in one forward)."""
    gen = torch.Generator().manual_seed(5)
    prompts = [[*torch.randint(SEP + 1, VOCAB, (COPY,), generator=gen).tolist(), SEP] for _ in range(16)]
    cfg = DecodeConfig(max_new_tokens=COPY, batch_size=batch_size)
    plain = decode(copier, prompts, cfg)
    assert (
        sum(o.tokens == p[:-1] for o, p in zip(plain, prompts, strict=True)) >= 14
    )  # the premise: it copies
    drafted = decode(copier, prompts, dataclasses.replace(cfg, draft="prompt", draft_tokens=10))
    _same(drafted, plain)
    assert [o.nfe for o in plain] == [COPY] * len(prompts)
    assert sum(o.nfe for o in drafted) <= 3 * len(prompts)


def test_drafts_are_refused_where_they_are_not_lossless() -> None:
    """Each drafter only where its promise holds: the lossless ones (`draft`) in greedy AR decoding,
    the lossy copy drafts (`copy_drafts`) in block diffusion under the `prefix` rule."""
    model, prompts = tiny_model(), random_prompts([5])
    for cfg in (
        DecodeConfig(block_size=4, mask_token_id=MASK, draft="prompt"),
        DecodeConfig(block_size=4, mask_token_id=MASK, draft="model"),
        DecodeConfig(do_sample=True, draft="prompt"),
        DecodeConfig(draft="prompt", draft_tokens=0),
    ):
        with pytest.raises(ValueError, match="lossless drafts .* need AR greedy decoding"):
            decode(model, prompts, cfg)
    for cfg in (
        DecodeConfig(block_size=4, mask_token_id=MASK, copy_drafts=True, commit_rule="confident"),
        DecodeConfig(copy_drafts=True),  # AR: nothing to copy into
    ):
        with pytest.raises(ValueError, match="copy drafts .* need block diffusion"):
            decode(model, prompts, cfg)
    with pytest.raises(ValueError, match="draft must be one of"):
        decode(model, prompts, DecodeConfig(draft="ngram"))


def _drafter_like(model: PreTrainedModel, mask_id: int, block_size: int = 4) -> PreTrainedModel:
    """`model`'s weights as a block-diffusion drafter: its first proposal is the target's own next
    token (the last written token's logit, causal), so every drafted forward writes at least two."""
    drafter = copy.deepcopy(model)
    drafter.config.block_size, drafter.config.mask_token_id = block_size, mask_id
    return drafter


@pytest.mark.parametrize("batch_size", [1, 16])
@pytest.mark.parametrize(("constrained", "jump_forward"), [(True, True), (True, False), (False, True)])
def test_model_drafts_are_exact(
    world, batch_size: int, constrained: bool, jump_forward: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block-diffusion drafter's drafts, verified by the AR target: the target's own greedy tokens,
    log-probs and corrections, free and under the grammar, alone and 16 rows at once (holes in the
    drafter's cache counted, so the case is real), from a drafter that shares the target's weights
    (most first proposals kept: a wrong drafter cache or position would show as fewer forwards saved)
    and from an unrelated one (most proposals rejected). Alone: the first 4 prompts (each decodes
    by itself: 16 would cost 4x for the same paths)."""
    tokenizer, model, cfg, prompts, grammars, plain, holes = _plain_case(
        world, batch_size, constrained, jump_forward, monkeypatch, n=4 if batch_size == 1 else 16
    )
    twin = _drafter_like(model, tokenizer.mask_token_id)
    unrelated = tiny_model_for(tokenizer, block_size=4, num_layers=2)
    torch.manual_seed(3)
    for p in unrelated.parameters():
        p.data.normal_(0, 0.2)
    for drafter in (twin, unrelated):
        drafted = decode(
            model, prompts, dataclasses.replace(cfg, draft="model", draft_tokens=4), grammars, drafter=drafter
        )
        _same(drafted, plain)
        if drafter is twin and batch_size == 1 and not constrained:  # >= 2 tokens a forward, but the last
            assert sum(a.nfe for a in drafted) <= 0.6 * sum(b.nfe for b in plain)
    assert (sum(holes) > 0) == (batch_size > 1)


def test_model_drafts_are_refused_without_a_diffusion_drafter(world) -> None:
    tokenizer, requests = world
    model = tiny_model_for(tokenizer)
    prompts = [list(p) for p in requests["prompt_ids"]][:2]
    cfg = DecodeConfig(max_new_tokens=8, draft="model", draft_tokens=4)
    with pytest.raises(ValueError, match="a drafter model goes with draft 'model'"):
        decode(model, prompts, cfg)
    with pytest.raises(ValueError, match="must be a block-diffusion model"):
        decode(model, prompts, cfg, drafter=tiny_model_for(tokenizer))
    with pytest.raises(ValueError, match="exceeds the drafter's block size 2"):
        decode(model, prompts, cfg, drafter=tiny_model_for(tokenizer, block_size=2))


@pytest.mark.parametrize("constrained", [True, False])
def test_copy_drafts_decode_the_same_cached_and_recomputed(world, constrained: bool) -> None:
    """Diffusion copy drafts re-block the canvas (each draft seen only by the positions after it):
    the cache-free runner, which builds the predicate's mask from the same ids, decodes the same,
    alone and 16 rows at once; and the drafts were used (fewer forwards than without them)."""
    tokenizer, requests = world
    model = tiny_model_for(tokenizer, block_size=4, num_layers=2)
    cfg = DecodeConfig(
        block_size=4,
        threshold=0.3,
        mask_token_id=tokenizer.mask_token_id,
        max_new_tokens=48,
        eos_token_ids=(tokenizer.convert_tokens_to_ids(IM_END),),
        copy_drafts=True,
        draft_tokens=3,
    )
    prompts = [list(p) for p in requests["prompt_ids"]][:6]
    grammars = request_grammars(tokenizer, requests)[:6] if constrained else None
    for b in (1, 16):
        cached = decode(model, prompts, dataclasses.replace(cfg, batch_size=b), grammars)
        recomputed = decode(model, prompts, dataclasses.replace(cfg, batch_size=b, recompute=True), grammars)
        for a, c in zip(cached, recomputed, strict=True):
            assert (a.tokens, a.commit_steps, a.forced) == (c.tokens, c.commit_steps, c.forced)
            assert a.token_logprobs == pytest.approx(c.token_logprobs, abs=1e-4)


def test_copy_drafts_let_a_copying_model_write_a_block_in_one_forward(copier: PreTrainedModel) -> None:
    """The copier as a block-diffusion model (block 4, tau 0.99): without drafts it is never that
    sure of a masked position past the first (it never saw masks) and writes a token a forward;
    with them the check of each draft reads the drafts before it, causally, as it was trained, and
    blocks take one or two forwards: the same copies in half the forwards."""
    diffusion = copy.deepcopy(copier)
    diffusion.config.block_size, diffusion.config.mask_token_id = 4, MASK
    gen = torch.Generator().manual_seed(5)
    prompts = [[*torch.randint(SEP + 1, VOCAB, (COPY,), generator=gen).tolist(), SEP] for _ in range(16)]
    cfg = DecodeConfig(block_size=4, threshold=0.99, mask_token_id=MASK, max_new_tokens=COPY, batch_size=16)
    plain = decode(diffusion, prompts, cfg)
    drafted = decode(diffusion, prompts, dataclasses.replace(cfg, copy_drafts=True, draft_tokens=3))
    copies = sum(o.tokens == p[:-1] for o, p in zip(drafted, prompts, strict=True))
    assert copies >= 14
    assert [o.nfe for o in plain] == [COPY] * len(prompts)
    assert sum(o.nfe for o in drafted) <= 5 * len(prompts)  # 3 blocks (10 = 4 + 4 + 2)
