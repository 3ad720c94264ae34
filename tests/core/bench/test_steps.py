"""The profiled decoding steps compute the LM-head rows the decoder reads (issue 28: never zero)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffusion_gr2.core.bench.steps import DecodeStep, StepRunner, decode_steps
from diffusion_gr2.core.decode.decoder import DecodeConfig, decode
from diffusion_gr2.core.decode.runner import CachedRunner
from tests.core.model.tiny import EOS, MASK, PAD, random_prompts, tiny_model_for, tiny_tokenizer

K = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model_for(tiny_tokenizer(), block_size=K)


def test_each_step_kind_computes_its_pinned_logit_width(model) -> None:
    steps = decode_steps(K, widths=(1, 2, 4, 8))
    # the pinned widths: one row for an AR step, the masked positions of a canvas, q for a fused step
    assert {name: s.logit_rows for name, s in steps.items()} == {
        "ar_step": 1,
        "canvas_2": 1,
        "canvas_4": 3,
        "fused_4+1": 1,
        "fused_4+2": 2,
        "fused_4+4": 4,
    }  # canvas_1 never runs (a later step feeds >= 2 positions), no canvas is wider than the block
    runner = StepRunner(model, random_prompts([9])[0], batch=3, k=K, width=2 * K, backend="lean")
    v = model.config.vocab_size
    for name, step in steps.items():
        n, cached = runner.runner.n, runner.runner.cache.get_seq_length()
        first = runner.run(step)
        assert first.shape == (3, step.logit_rows, v), name  # the LM head really runs, on these rows
        assert (runner.runner.n, runner.runner.cache.get_seq_length()) == (n, cached)  # cache restored
        torch.testing.assert_close(runner.run(step), first)  # so a repeat is the same step


def test_the_step_kinds_are_the_decoders_own_steps(model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every forward of a real decode has the shape of a profiled kind (the canvas ones up to lo)."""
    seen: list[tuple[int, int, int, int]] = []  # (clean, canvas, lo, logit rows) of each forward
    real = CachedRunner.forward

    def spy(self, clean, canvas, canvas_valid, lo=0, checked=0, **kw):
        logits = real(self, clean, canvas, canvas_valid, lo, checked, **kw)
        c, q = (0 if t is None else t.shape[1] for t in (clean, canvas))
        seen.append((c, q, lo, logits.shape[1]))
        return logits

    monkeypatch.setattr(CachedRunner, "forward", spy)
    prompts = random_prompts([7, 9])
    base = DecodeConfig(max_new_tokens=12, batch_size=2, eos_token_ids=(EOS,), pad_token_id=PAD)
    decode(model, prompts, dataclasses.replace(base, block_size=K, mask_token_id=MASK, threshold=0.9))
    diffusion = seen[1:]  # after the prompt's forward
    assert all(rows == DecodeStep(c, q, lo).logit_rows >= 1 for c, q, lo, rows in diffusion)
    kinds = {(s.clean, s.canvas, s.lo) for s in decode_steps(K).values()}
    assert (K, K, 0) in {(c, q, lo) for c, q, lo, _ in diffusion} and (K, K, 0) in kinds  # fused
    assert (0, K, 1) in {(c, q, lo) for c, q, lo, _ in diffusion} and (0, K, 1) in kinds  # canvas_k
    assert all(c in (0, K) and (c == 0) == (lo >= 1) for c, _, lo, _ in diffusion)
    seen.clear()
    decode(model, prompts, base)  # AR: after the prompt, one clean token and one LM-head row a step
    assert {(c, q, rows) for c, q, _, rows in seen[1:]} == {(1, 0, 1)}
