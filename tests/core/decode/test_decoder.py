"""The decoder: B = 1 vs `generate`, cached vs recompute, batched vs one-by-one, stopping, sampling."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from diffusion_gr2.core.decode import runner as decode_runner
from diffusion_gr2.core.decode.commit import commit_mask as _commit_mask
from diffusion_gr2.core.decode.commit import repeat_gated
from diffusion_gr2.core.decode.decoder import DecodeConfig, DecodeOutput, decode, left_pad_prompts
from diffusion_gr2.core.decode.kv_cache import BufferLayer
from diffusion_gr2.core.decode.runner import CachedRunner as _CachedRunner
from diffusion_gr2.core.model.masks import prompt_response_layout
from tests.core.model.tiny import (
    ATOL,
    DEVICE,
    MASK,
    random_prompts,
    same_weights,
    tiny_model,
    uncompiled_flex_on_cpu,
)

torch.set_num_threads(1)
LENGTHS = [7, 12, 3, 9, 5]


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return tiny_model()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(LENGTHS)


def _generate(model: PreTrainedModel, prompt: list[int], n: int, eos: tuple[int, ...] = ()) -> list[int]:
    kwargs = {"eos_token_id": list(eos)} if eos else {}
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        do_sample=False,
        max_new_tokens=n,
        pad_token_id=0,
        **kwargs,
    )
    return out[0, len(prompt) :].tolist()


def _eos_ending_rows_at_different_times(outputs: list[DecodeOutput], k: int) -> tuple[int, ...]:
    """Two tokens of a run without eos that, as eos, end rows mid-block and at different times."""
    return outputs[0].tokens[k + 1], outputs[1].tokens[3 * k + 2]


def test_block_size_one_reproduces_generate(model: PreTrainedModel, prompts: list[list[int]]) -> None:
    ours = decode(model, prompts, DecodeConfig(max_new_tokens=16, batch_size=3))
    for prompt, out in zip(prompts, ours, strict=True):
        assert out.tokens == _generate(model, prompt, 16)
        assert out.nfe == 16 and out.commit_steps == [0] * 16  # one forward per token
    alone = decode(model, prompts[:1], DecodeConfig(max_new_tokens=16))[0]
    assert alone.tokens == ours[0].tokens


def test_block_size_one_with_eos_matches_generate_batched(
    model: PreTrainedModel, prompts: list[list[int]]
) -> None:
    free = decode(model, prompts, DecodeConfig(max_new_tokens=16))
    eos = _eos_ending_rows_at_different_times(free, 1)
    ours = decode(model, prompts, DecodeConfig(max_new_tokens=16, eos_token_ids=eos))
    assert len({len(o.tokens) for o in ours}) > 1  # rows really finish at different times
    for prompt, out in zip(prompts, ours, strict=True):
        assert out.tokens == _generate(model, prompt, 16, eos)
        assert out.nfe == len(out.tokens)


def test_block_size_one_recompute_equals_cached(model: PreTrainedModel, prompts: list[list[int]]) -> None:
    cfg = DecodeConfig(max_new_tokens=12)
    cached = decode(model, prompts, cfg)
    full = decode(model, prompts, dataclasses.replace(cfg, recompute=True))
    assert [o.tokens for o in cached] == [o.tokens for o in full]


@pytest.mark.parametrize(
    ("k", "tau", "rule", "fused"),
    [
        (4, 0.9, "prefix", True),
        (4, 0.5, "prefix", False),
        (8, 0.3, "prefix", True),
        (8, 0.3, "confident", True),
        (8, 0.3, "confident", False),
    ],
)
def test_block_cached_equals_recompute(
    model: PreTrainedModel, prompts: list[list[int]], k: int, tau: float, rule: str, fused: bool
) -> None:
    cfg = DecodeConfig(
        block_size=k, threshold=tau, max_new_tokens=22, mask_token_id=MASK, commit_rule=rule, fused=fused
    )
    cached = decode(model, prompts, cfg)
    full = decode(model, prompts, dataclasses.replace(cfg, recompute=True))
    for a, b in zip(cached, full, strict=True):
        assert (a.tokens, a.commit_steps, a.nfe) == (b.tokens, b.commit_steps, b.nfe)
        torch.testing.assert_close(
            torch.tensor(a.token_logprobs), torch.tensor(b.token_logprobs), atol=ATOL, rtol=0
        )
    steps = [s for o in cached for s in o.commit_steps]
    assert max(steps) > 1  # several steps in some block ...
    if tau <= 0.5:
        assert sum(o.nfe for o in cached) < sum(
            len(o.tokens) for o in cached
        )  # ... fewer forwards than tokens


@pytest.mark.parametrize("k", [1, 4])
def test_batched_equals_one_by_one_with_rows_ending_at_different_times(
    model: PreTrainedModel, prompts: list[list[int]], k: int
) -> None:
    cfg = DecodeConfig(block_size=k, threshold=0.5, max_new_tokens=20, mask_token_id=MASK, batch_size=4)
    eos = _eos_ending_rows_at_different_times(decode(model, prompts, cfg), k)
    cfg = dataclasses.replace(cfg, eos_token_ids=eos)
    batched = decode(model, prompts, cfg)
    assert len({len(o.tokens) for o in batched}) > 1
    for prompt, out in zip(prompts, batched, strict=True):
        single = decode(model, [prompt], cfg)[0]
        assert (out.tokens, out.commit_steps, out.nfe) == (single.tokens, single.commit_steps, single.nfe)
        if out.tokens[-1] in eos:  # stops at (and keeps) the first end-of-output token
            assert not set(out.tokens[:-1]) & set(eos)
        else:
            assert len(out.tokens) == 20 and not set(out.tokens) & set(eos)


_CONF = torch.tensor(
    [[0.95, 0.3, 0.92, 0.6], [0.2, 0.4, 0.3, 0.99], [0.1, 0.5, 0.97, 0.3], [0.1, 0.5, 0.3, 0.97], [0.5] * 4]
)
_CAND = torch.tensor(
    [[True] * 4, [True, True, True, False], [False, True, True, True], [False, True, True, True], [False] * 4]
)
T, F = True, False


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        # above tau (0.9) plus the most confident candidate (Fast-dLLM v2)
        ("confident", [[T, F, T, F], [F, T, F, F], [F, F, T, F], [F, F, F, T], [F] * 4]),
        # the leftmost candidate and the unbroken run above tau right after it
        ("prefix", [[T, F, F, F], [T, F, F, F], [F, T, T, F], [F, T, F, F], [F] * 4]),
    ],
)
def test_commit_rules_on_hand_checked_confidences(rule: str, expected: list[list[bool]]) -> None:
    rows = list(zip(_CAND.tolist(), _CONF.log().tolist(), strict=True))
    assert [_commit_mask(cand, logp, 0.9, fill=False, rule=rule) for cand, logp in rows] == expected
    assert [_commit_mask(cand, logp, 0.9, fill=True, rule=rule) for cand, logp in rows] == _CAND.tolist()


def test_prefix_rule_writes_each_block_left_to_right(
    model: PreTrainedModel, prompts: list[list[int]]
) -> None:
    cfg = DecodeConfig(
        block_size=8, threshold=0.3, max_new_tokens=24, mask_token_id=MASK, commit_rule="prefix"
    )
    outputs = decode(model, prompts, cfg)
    for out in outputs:
        for start in range(0, len(out.tokens), 8):
            steps = out.commit_steps[start : start + 8]
            assert steps == sorted(steps)  # never a token right of a still-masked one
    assert sum(o.nfe for o in outputs) < sum(len(o.tokens) for o in outputs)  # and still in parallel
    with pytest.raises(ValueError, match="commit_rule"):
        decode(model, prompts[:1], dataclasses.replace(cfg, commit_rule="random"))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("rule", ["confident", "prefix"])
def test_every_step_commits_and_parallel_commits_are_confident(
    model: PreTrainedModel, prompts: list[list[int]], rule: str, fused: bool
) -> None:
    cfg = DecodeConfig(
        block_size=4, threshold=0.5, max_new_tokens=20, mask_token_id=MASK, commit_rule=rule, fused=fused
    )
    for out in decode(model, prompts, cfg):
        probs = torch.tensor(out.token_logprobs).exp()
        for start in range(0, len(out.tokens), 4):
            steps = out.commit_steps[start : start + 4]
            # the first token: by the block's first forward (fused) or by the previous one (step 0)
            assert steps[0] == (1 if fused else 0)
            assert sorted(set(steps) - {0}) == list(range(1, max(steps) + 1))  # progress at every step
            for s in set(steps) - {0}:
                group = [start + i for i, t in enumerate(steps) if t == s]
                # several at once: all passed the threshold, except the one that guarantees progress
                # (the first token in a fused first forward; the leftmost one under "prefix")
                free = group[:1] if rule == "prefix" or (fused and s == 1) else []
                if len(group) > 1:
                    assert bool((probs[[i for i in group if i not in free]] > 0.5).all())


def _codes_ride_along(out: DecodeOutput, codes: frozenset[int], k: int, start: int = 0) -> bool:
    """Whether a code at index >= `start` of `out` was committed beside others, not first in its
    forward's run (a parallel commit)."""
    for lo in range(0, len(out.tokens), k):
        steps = out.commit_steps[lo : lo + k]
        for s in set(steps):
            group = [lo + i for i, t in enumerate(steps) if t == s]
            if any(i >= start and out.tokens[i] in codes for i in group[1:]):
                return True
    return False


def test_sid_codes_commit_in_parallel_only_above_their_own_threshold(
    model: PreTrainedModel, prompts: list[list[int]]
) -> None:
    cfg = DecodeConfig(block_size=8, threshold=0.3, max_new_tokens=24, mask_token_id=MASK)
    plain = decode(model, prompts, cfg)
    codes = frozenset(t for o in plain for t in o.tokens[1::2])  # stand-ins for SID codes
    # a SID tau equal to tau changes nothing: those choices were not above it anyway
    same = decode(model, prompts, dataclasses.replace(cfg, sid_threshold=0.3, sid_token_ids=codes))
    assert [o.tokens for o in same] == [o.tokens for o in plain]
    strict = decode(model, prompts, dataclasses.replace(cfg, sid_threshold=1.0, sid_token_ids=codes))
    assert sum(o.nfe for o in strict) > sum(o.nfe for o in plain)  # fewer parallel commits
    assert any(_codes_ride_along(o, codes, 8) for o in plain)  # the check below can fail
    # a code never rides along: it is only committed where a commit is due (the run's first)
    assert not any(_codes_ride_along(o, codes, 8) for o in strict)


def test_sid_threshold_holds_only_after_its_marker(model: PreTrainedModel, prompts: list[list[int]]) -> None:
    """`sid_after` (the ranking list's key): up to the marker the answer is the plain decode's, token
    for token and forward for forward; after it no code rides along in a parallel commit."""
    cfg = DecodeConfig(block_size=8, threshold=0.3, max_new_tokens=24, mask_token_id=MASK)
    plain = decode(model, prompts, cfg)
    codes = frozenset(t for o in plain for t in o.tokens[1::2])
    strict = dataclasses.replace(cfg, sid_threshold=1.0, sid_token_ids=codes)
    marker = plain[0].tokens[9]  # a token the first row writes mid-answer, in its second block
    scoped = decode(model, prompts, dataclasses.replace(strict, sid_after=(marker,)))
    assert [o.tokens for o in scoped] != [o.tokens for o in decode(model, prompts, strict)]
    for p, s in zip(plain, scoped, strict=True):
        end = p.tokens.index(marker) + 1 if marker in p.tokens else len(p.tokens)
        assert s.tokens[:end] == p.tokens[:end] and s.commit_steps[:end] == p.commit_steps[:end]
        assert not _codes_ride_along(s, codes, 8, start=end)
    assert _codes_ride_along(plain[0], codes, 8, start=10)  # plain's do there: the check above can fail


def _parallel_repeats(out: DecodeOutput, k: int) -> int:
    """Adjacent equal tokens of one block committed by the same forward (the step cap's fill aside)."""
    steps, tokens = out.commit_steps, out.tokens
    return sum(
        i // k == (i + 1) // k and steps[i] == steps[i + 1] < k and tokens[i] == tokens[i + 1]
        for i in range(len(tokens) - 1)
    )


def test_repeat_gate_commits_no_repeat_in_parallel(model: PreTrainedModel, prompts: list[list[int]]) -> None:
    cfg = DecodeConfig(block_size=8, threshold=0.0, max_new_tokens=24, mask_token_id=MASK, repeat_gate=False)
    plain = decode(model, prompts, cfg)
    assert sum(_parallel_repeats(o, 8) for o in plain) > 0  # the check below can fail
    gated = decode(model, prompts, dataclasses.replace(cfg, repeat_gate=True))
    assert sum(_parallel_repeats(o, 8) for o in gated) == 0
    assert sum(o.nfe for o in gated) > sum(o.nfe for o in plain)


def test_repeat_gated_leaves_a_due_repeat_alone() -> None:
    conf = [-0.1, -0.2, -0.3, -0.4]
    # position 2 repeats position 1, both open: unconfident; position 1 repeats position 0, which
    # was written before this forward (not open): it keeps its confidence
    assert repeat_gated(conf, [5, 5, 5, 7], [False, True, True, True]) == [-0.1, -0.2, -math.inf, -0.4]


@pytest.mark.parametrize(("fused", "nfe"), [(True, 2 + 2), (False, 1 + 2 + 1 + 2)])
def test_step_cap_fills_the_block(
    model: PreTrainedModel, prompts: list[list[int]], fused: bool, nfe: int
) -> None:
    cfg = DecodeConfig(
        block_size=8,
        threshold=1.0,
        max_new_tokens=16,
        mask_token_id=MASK,
        max_steps_per_block=2,
        fused=fused,
        window=2,  # the cap feeds the whole block whatever the window
    )
    for out in decode(model, prompts, cfg):
        assert max(out.commit_steps) <= 2 and len(out.tokens) == 16 and MASK not in out.tokens
        # fused: 2 forwards per block, the first also writing the prompt / previous block;
        # else: prefill, 2 steps, the block's own forward, 2 steps (the last block needs no commit)
        assert out.nfe == nfe


def test_fused_forward_writes_the_same_cache_and_first_token(
    model: PreTrainedModel, prompts: list[list[int]]
) -> None:
    """[clean block | next canvas] in one forward = the clean block's own forward, then the canvas."""
    k, dev = 4, model.device
    ids, valid = left_pad_prompts(prompts, 0, dev)
    layout = prompt_response_layout(valid, torch.ones(len(prompts), 3 * k, dtype=torch.bool, device=dev), k)
    block = torch.randint(2, 120, (len(prompts), k), generator=torch.Generator().manual_seed(0)).to(dev)
    canvas = torch.full((len(prompts), k), MASK, device=dev)
    today, fused = _CachedRunner(model, layout), _CachedRunner(model, layout)
    for runner in (today, fused):
        runner.forward(ids, None, None)  # prefill
    first = today.forward(block, None, None)[:, 0]
    both = fused.forward(block, canvas, torch.ones_like(canvas, dtype=torch.bool))
    torch.testing.assert_close(both[:, 0], first, atol=ATOL, rtol=0)  # the next block's first token
    assert torch.equal(both[:, 0].argmax(-1), first.argmax(-1))
    assert today.n == fused.n == ids.shape[1] + k
    for a, b in zip(today.cache.layers, fused.cache.layers, strict=True):
        assert a.get_seq_length() == b.get_seq_length() == today.n  # the canvas is not kept
        torch.testing.assert_close(a.keys[:, :, : today.n], b.keys[:, :, : today.n], atol=ATOL, rtol=0)
        torch.testing.assert_close(a.values[:, :, : today.n], b.values[:, :, : today.n], atol=ATOL, rtol=0)


@pytest.mark.parametrize("fused", [True, False])
def test_window_of_the_block_size_is_the_whole_canvas(
    model: PreTrainedModel, prompts: list[list[int]], fused: bool
) -> None:
    cfg = DecodeConfig(block_size=8, threshold=0.3, max_new_tokens=24, mask_token_id=MASK, fused=fused)
    whole = decode(model, prompts, cfg)
    for window in (8, 100):
        same = decode(model, prompts, dataclasses.replace(cfg, window=window))
        for a, b in zip(whole, same, strict=True):
            assert (a.tokens, a.commit_steps, a.nfe) == (b.tokens, b.commit_steps, b.nfe)
            assert a.token_logprobs == b.token_logprobs
    narrow = decode(model, prompts, dataclasses.replace(cfg, window=2))
    assert [o.tokens for o in narrow] != [o.tokens for o in whole]  # a narrow window really drops keys
    with pytest.raises(ValueError, match="window"):
        decode(model, prompts, dataclasses.replace(cfg, window=0))


@pytest.mark.parametrize("rule", ["prefix", "confident"])
def test_windowed_rows_do_not_depend_on_their_batch(
    model: PreTrainedModel, prompts: list[list[int]], rule: str
) -> None:
    """Each row feeds its own window (the rest are keys nobody sees), whatever its neighbours feed."""
    cfg = DecodeConfig(
        block_size=8, threshold=0.4, max_new_tokens=24, mask_token_id=MASK, window=3, commit_rule=rule
    )
    batched = decode(model, prompts, cfg)
    full = decode(model, prompts, dataclasses.replace(cfg, recompute=True))
    for prompt, out, ref in zip(prompts, batched, full, strict=True):
        single = decode(model, [prompt], cfg)[0]
        assert (out.tokens, out.commit_steps, out.nfe) == (single.tokens, single.commit_steps, single.nfe)
        assert (out.tokens, out.commit_steps) == (ref.tokens, ref.commit_steps)


def test_max_new_tokens_not_a_multiple_of_the_block(model: PreTrainedModel, prompts: list[list[int]]) -> None:
    cfg = DecodeConfig(block_size=4, threshold=0.9, max_new_tokens=10, mask_token_id=MASK)
    for out in decode(model, prompts, cfg):
        assert len(out.tokens) == len(out.commit_steps) == len(out.token_logprobs) == 10
        assert len(out.tail_tokens) == len(out.tail_steps) == 2


def test_sampling_is_seeded(model: PreTrainedModel, prompts: list[list[int]]) -> None:
    cfg = DecodeConfig(
        block_size=4, threshold=0.7, max_new_tokens=16, mask_token_id=MASK, do_sample=True, temperature=1.5
    )
    first, again = decode(model, prompts, cfg), decode(model, prompts, cfg)
    other = decode(model, prompts, dataclasses.replace(cfg, seed=1))
    assert [o.tokens for o in first] == [o.tokens for o in again]
    assert [o.tokens for o in first] != [o.tokens for o in other]
    greedy = decode(model, prompts, dataclasses.replace(cfg, do_sample=False))
    assert [o.tokens for o in first] != [o.tokens for o in greedy]


def test_block_size_above_one_needs_the_mask_token(model: PreTrainedModel, prompts: list[list[int]]) -> None:
    with pytest.raises(ValueError, match="mask_token_id"):
        decode(model, prompts, DecodeConfig(block_size=4))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("block_size", [1, 4])
def test_lean_and_every_attention_of_the_modules_decode_the_same(
    model: PreTrainedModel, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch, block_size: int
) -> None:
    """`backend: lean` (the default) against `backend: eager` under sdpa, eager and flex attention."""
    uncompiled_flex_on_cpu(monkeypatch)
    cfg = DecodeConfig(
        block_size=block_size, threshold=0.5, max_new_tokens=8, mask_token_id=MASK, batch_size=3
    )
    ref = decode(model, prompts, cfg)
    lean = decode_runner.lean_forward(model, cfg.backend, 64)
    assert cfg.backend == "auto" and lean is not None  # lean runs
    for attn in ("sdpa", "eager", "flex_attention"):
        out = decode(same_weights(model, attn), prompts, dataclasses.replace(cfg, backend="eager"))
        assert [(o.tokens, o.commit_steps, o.nfe) for o in out] == [
            (o.tokens, o.commit_steps, o.nfe) for o in ref
        ]
        for a, b in zip(out, ref, strict=True):
            assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=ATOL)


def test_unknown_backend_is_refused(model: PreTrainedModel, prompts: list[list[int]]) -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        decode(model, prompts, DecodeConfig(backend="compiled"))


def test_auto_backend_decodes_models_lean_does_not_cover_with_the_modules(prompts: list[list[int]]) -> None:
    """A Llama (the pretrained SmolLM2 path): `auto` runs the transformers modules, `lean` refuses."""
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, pad_token_id=0,
    )  # fmt: skip
    llama = LlamaForCausalLM(config).eval().to(DEVICE)
    cfg = DecodeConfig(max_new_tokens=6)
    auto, eager = (decode(llama, prompts, dataclasses.replace(cfg, backend=b)) for b in ("auto", "eager"))
    assert [o.tokens for o in auto] == [o.tokens for o in eager]
    with pytest.raises(ValueError, match=r"model_type 'llama'.*backend 'eager'"):
        decode(llama, prompts, dataclasses.replace(cfg, backend="lean"))


def test_buffer_cache_crops_and_refuses_overflow() -> None:
    layer = BufferLayer(capacity=4)
    keys = torch.randn(1, 2, 3, 8)
    k, _ = layer.update(keys, keys)
    assert torch.equal(k, keys) and layer.get_seq_length() == 3
    layer.crop(-2)
    k, _ = layer.update(keys[:, :, :1] + 1, keys[:, :, :1])
    assert torch.equal(k[:, :, 0], keys[:, :, 0]) and torch.equal(k[:, :, 1], keys[:, :, 0] + 1)
    with pytest.raises(ValueError, match="capacity"):
        layer.update(keys, keys)


@pytest.mark.parametrize("recompute", [False, True])
def test_rows_done_with_their_block_are_not_computed_and_change_nothing(
    model: PreTrainedModel, prompts: list[list[int]], recompute: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward feeds only the rows still unmasking their block (swapped to the first slots)."""
    cfg = DecodeConfig(
        block_size=4, threshold=0.5, max_new_tokens=12, mask_token_id=MASK, batch_size=5, recompute=recompute
    )
    fed_rows: list[int] = []
    runner = decode_runner.RecomputeRunner if recompute else _CachedRunner
    forward = runner.forward

    def counted(self, clean, canvas, canvas_valid, lo=0, **kw):  # type: ignore[no-untyped-def]
        fed_rows.append((canvas if canvas is not None else clean).shape[0])
        return forward(self, clean, canvas, canvas_valid, lo, **kw)

    monkeypatch.setattr(runner, "forward", counted)
    batched = decode(model, prompts, cfg)
    assert min(fed_rows) < len(prompts), "no forward left a finished row out: nothing was tested"
    monkeypatch.setattr(runner, "forward", forward)
    for prompt, out in zip(prompts, batched, strict=True):
        single = decode(model, [prompt], cfg)[0]
        assert (out.tokens, out.commit_steps, out.nfe) == (single.tokens, single.commit_steps, single.nfe)
        torch.testing.assert_close(out.token_logprobs, single.token_logprobs, atol=ATOL, rtol=0)
