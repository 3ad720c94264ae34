"""Replay and the token-shift convention: training-side forwards reproduce the decoder's numbers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import PreTrainedModel

from diffusion_gr2.core.decode.decoder import DecodeConfig, DecodeOutput, decode
from diffusion_gr2.core.decode.replay import replay_batch_logits, replay_logits, replay_logprobs
from diffusion_gr2.core.model.diffusion import response_logits
from tests.core.model.tiny import ATOL, DEVICE, MASK, random_prompts, tiny_model

torch.set_num_threads(1)
PROMPTS = random_prompts([7, 12, 3, 9])


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return tiny_model()


def _decode_with_mid_block_eos(
    model: PreTrainedModel,
    k: int,
    tau: float,
    rule: str = "confident",
    fused: bool = True,
    window: int | None = None,
) -> list[DecodeOutput]:
    """Rows ending at an eos inside a block (so the final block has a tail), and one without eos."""
    cfg = DecodeConfig(
        block_size=k,
        threshold=tau,
        max_new_tokens=24,
        mask_token_id=MASK,
        commit_rule=rule,
        fused=fused,
        window=window,
    )
    free = decode(model, PROMPTS, cfg)
    eos = (free[0].tokens[k + 1], free[2].tokens[min(2 * k + 2, 21)])
    return decode(model, PROMPTS, dataclasses.replace(cfg, eos_token_ids=eos))


def _assert_logprobs_close(got: torch.Tensor, out: DecodeOutput) -> None:
    torch.testing.assert_close(got.cpu(), torch.tensor(out.token_logprobs), atol=2 * ATOL, rtol=0)


@pytest.mark.parametrize(
    ("k", "tau", "rule", "fused", "window"),
    [
        (1, 0.9, "prefix", True, None),
        (4, 0.9, "confident", True, None),
        (4, 0.5, "confident", False, None),
        (8, 0.5, "confident", True, None),
        (8, 0.3, "prefix", True, None),
        (8, 0.3, "prefix", False, None),
        (8, 0.3, "prefix", True, 3),
        (8, 0.5, "confident", False, 2),
    ],
)
@torch.no_grad()
def test_replay_reproduces_the_decoder_logprobs(
    model: PreTrainedModel, k: int, tau: float, rule: str, fused: bool, window: int | None
) -> None:
    outputs = _decode_with_mid_block_eos(model, k, tau, rule, fused, window)
    batch = replay_batch_logits(model, PROMPTS, outputs, k, MASK, window=window).log_softmax(-1)
    for i, out in enumerate(outputs):
        taken = batch[i, : len(out.tokens)].gather(-1, torch.tensor(out.tokens, device=DEVICE)[:, None])
        _assert_logprobs_close(taken.squeeze(-1), out)
        if window is None:
            assert replay_logits(model, PROMPTS[i], out, k, MASK).shape == (len(out.tokens), 128)


@pytest.mark.parametrize(("k", "tau"), [(1, 0.9), (4, 0.5), (8, 0.5)])
@torch.no_grad()
def test_batched_replay_equals_each_rollout_alone(model: PreTrainedModel, k: int, tau: float) -> None:
    """Prompts of different lengths, outputs of different lengths (mid-block eos, tails) in one batch."""
    outputs = _decode_with_mid_block_eos(model, k, tau)
    assert len({len(o.tokens) for o in outputs}) > 1  # the batch really is ragged
    batch = replay_batch_logits(model, PROMPTS, outputs, k, MASK)
    assert batch.shape[:2] == (len(PROMPTS), max(len(o.tokens) for o in outputs))
    for i, (prompt, out) in enumerate(zip(PROMPTS, outputs, strict=True)):
        r = len(out.tokens)
        torch.testing.assert_close(
            batch[i, :r], replay_logits(model, prompt, out, k, MASK), atol=2 * ATOL, rtol=0
        )
        taken = torch.tensor(out.tokens, device=DEVICE)
        _assert_logprobs_close(batch[i, :r].log_softmax(-1).gather(-1, taken[:, None]).squeeze(-1), out)


def _visible_tail_case(outputs: list[DecodeOutput], k: int) -> tuple[int, int]:
    """(row, eos token) such that, with that eos, a token after it in the block was committed
    before the eos's block was finished: it sat on the canvas of later commits."""
    for row, out in enumerate(outputs):
        for j, tok in enumerate(out.tokens):
            start = j - j % k
            block = out.commit_steps[start : start + k]
            before, after = block[: j - start + 1], block[j - start + 1 :]
            if tok not in out.tokens[:j] and after and min(after) < max(before):
                return row, tok
    raise AssertionError("no visible tail in this fixture")


@torch.no_grad()
def test_replay_needs_the_tail_of_the_final_block(model: PreTrainedModel) -> None:
    # "confident" commits out of order (the "prefix" rule writes left to right: no token after the
    # eos is ever seen by an earlier one)
    cfg = DecodeConfig(
        block_size=8, threshold=0.5, max_new_tokens=24, mask_token_id=MASK, commit_rule="confident"
    )
    row, eos = _visible_tail_case(decode(model, PROMPTS, cfg), 8)
    out = decode(model, PROMPTS[row : row + 1], dataclasses.replace(cfg, eos_token_ids=(eos,)))[0]
    assert out.tokens[-1] == eos and any(s > 0 for s in out.tail_steps)
    _assert_logprobs_close(replay_logprobs(model, PROMPTS[row], out, 8, MASK), out)
    no_tail = dataclasses.replace(out, tail_tokens=[], tail_steps=[])
    assert not torch.allclose(
        replay_logprobs(model, PROMPTS[row], no_tail, 8, MASK).cpu(), torch.tensor(out.token_logprobs)
    )


@torch.no_grad()
def test_replay_of_sampled_rollouts_uses_the_temperature(model: PreTrainedModel) -> None:
    cfg = DecodeConfig(
        block_size=4, threshold=0.6, max_new_tokens=12, mask_token_id=MASK, do_sample=True, temperature=1.7
    )
    for prompt, out in zip(PROMPTS, decode(model, PROMPTS, cfg), strict=True):
        _assert_logprobs_close(replay_logprobs(model, prompt, out, 4, MASK, temperature=1.7), out)


def test_replay_is_differentiable(model: PreTrainedModel) -> None:
    cfg = DecodeConfig(block_size=4, threshold=0.5, max_new_tokens=8, mask_token_id=MASK)
    out = decode(model, PROMPTS[:1], cfg)[0]
    model.zero_grad()
    replay_logprobs(model, PROMPTS[0], out, 4, MASK).sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    model.zero_grad()


def _canvas_at_step(out: DecodeOutput, k: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Response (output + tail) and the noisy copy each block had at `step`: [1, r] each."""
    tokens = torch.tensor([*out.tokens, *out.tail_tokens])
    steps = torch.tensor([*out.commit_steps, *out.tail_steps])
    noisy = torch.where((steps >= 0) & (steps < step), tokens, MASK)
    return tokens[None].to(DEVICE), noisy[None].to(DEVICE)


@pytest.mark.parametrize("tau", [0.9, 0.5])
@torch.no_grad()
def test_training_forward_pins_the_token_shift_convention(model: PreTrainedModel, tau: float) -> None:
    """`response_logits` on the decoder's step-s canvas gives the logits the decoder committed from:
    position 0 of a block from the clean copy (previous block's last position), the rest from the
    noisy copy's previous position."""
    k = 4
    for prompt, out in zip(PROMPTS, _decode_with_mid_block_eos(model, k, tau), strict=True):
        steps = torch.tensor(out.commit_steps)
        checked = torch.zeros(len(out.tokens), dtype=torch.bool)
        for step in range(1, int(steps.max()) + 1):
            resp, noisy = _canvas_at_step(out, k, step)
            logp = response_logits(model, torch.tensor([prompt], device=DEVICE), resp, k, noisy)[
                0
            ].log_softmax(-1)
            taken = logp[: len(out.tokens)].gather(-1, resp[0, : len(out.tokens), None]).squeeze(-1).cpu()
            here = (steps == step) | (steps == 0)
            torch.testing.assert_close(
                taken[here], torch.tensor(out.token_logprobs)[here], atol=2 * ATOL, rtol=0
            )
            checked |= here
        assert bool(checked.all())
