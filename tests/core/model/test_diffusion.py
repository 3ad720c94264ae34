"""Forward passes under the masks: 2L training layout vs inference layout, backends, token shift."""

from __future__ import annotations

import pytest
import torch

from diffusion_gr2.core.model.diffusion import layout_hidden, response_logits
from diffusion_gr2.core.model.masks import prompt_response_layout, two_copy_layout
from tests.core.model.tiny import ATOL, DEVICE, MASK, same_weights, tiny_model, uncompiled_flex_on_cpu

K = 4
torch.set_num_threads(1)


def _batch() -> tuple[torch.Tensor, ...]:
    """Right-padded prompts [3, 9] and responses [3, 10] with a noisy (masked) copy."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 128, (3, 9), generator=gen)
    pm = torch.ones(3, 9, dtype=torch.bool)
    pm[0, 6:], pm[2, 3:] = False, False
    resp = torch.randint(3, 128, (3, 10), generator=gen)
    rm = torch.ones(3, 10, dtype=torch.bool)
    rm[1, 7:] = False
    noisy = torch.where(torch.rand(3, 10, generator=gen) < 0.5, MASK, resp)
    return tuple(t.to(DEVICE) for t in (prompt, pm, resp, rm, noisy))


@torch.no_grad()
def test_two_copy_clean_half_equals_block_causal_forward() -> None:
    model = tiny_model()
    prompt, pm, resp, rm, noisy = _batch()
    p, r = prompt.shape[1], resp.shape[1]
    two = layout_hidden(model, torch.cat([prompt, noisy, resp], 1), two_copy_layout(pm, rm, K))
    one = layout_hidden(model, torch.cat([prompt, resp], 1), prompt_response_layout(pm, rm, K))
    valid = torch.cat([pm, rm], 1)
    clean_half = torch.cat([two[:, :p], two[:, p + r :]], 1)
    torch.testing.assert_close(clean_half[valid], one[valid], atol=ATOL, rtol=1e-5)


@torch.no_grad()
def test_noisy_block_never_sees_later_blocks() -> None:
    model = tiny_model()
    prompt, pm, resp, rm, noisy = _batch()
    base = response_logits(model, prompt, resp, K, noisy, pm, rm)
    later_resp, later_noisy = resp.clone(), noisy.clone()
    later_resp[:, 2 * K :] = 7  # change blocks >= 2 in both copies
    later_noisy[:, 2 * K :] = 9
    changed = response_logits(model, prompt, later_resp, K, later_noisy, pm, rm)
    torch.testing.assert_close(changed[:, : 2 * K + 1], base[:, : 2 * K + 1], atol=ATOL, rtol=1e-5)
    assert not torch.allclose(changed[0, 2 * K + 1 :], base[0, 2 * K + 1 :])  # the test can fail


@torch.no_grad()
def test_noise_views_sharing_one_sequence_equal_separate_forwards() -> None:
    """CFT's complementary views as noisy copies of one sequence give each view's own 2L logits."""
    model = tiny_model()
    prompt, pm, resp, rm, noisy = _batch()
    other = torch.where(noisy == MASK, resp, MASK)  # the complementary view
    shared = response_logits(model, prompt, resp, K, torch.stack([noisy, other], 1), pm, rm)
    assert shared.shape[:3] == (3, 2, 10)
    for view, canvas in enumerate((noisy, other)):
        alone = response_logits(model, prompt, resp, K, canvas, pm, rm)
        torch.testing.assert_close(shared[:, view][rm], alone[rm], atol=ATOL, rtol=1e-5)
    assert not torch.allclose(shared[:, 0][rm], shared[:, 1][rm])  # the views really differ


@torch.no_grad()
def test_noisy_tokens_of_a_block_change_only_that_block() -> None:
    model = tiny_model()
    prompt, pm, resp, rm, noisy = _batch()
    base = response_logits(model, prompt, resp, K, noisy, pm, rm)
    other = noisy.clone()
    other[:, K + 1 : 2 * K] = MASK if bool((noisy[:, K + 1 : 2 * K] != MASK).any()) else 5
    changed = response_logits(model, prompt, resp, K, other, pm, rm)
    outside = torch.ones(10, dtype=torch.bool, device=DEVICE)
    outside[K + 1 : 2 * K] = False  # the block's first token comes from the clean copy: unaffected
    torch.testing.assert_close(changed[:, outside], base[:, outside], atol=ATOL, rtol=1e-5)
    assert not torch.allclose(changed[:, K + 1 : 2 * K], base[:, K + 1 : 2 * K])


@torch.no_grad()
def test_block_size_one_is_the_shifted_causal_forward() -> None:
    model = tiny_model()
    prompt, pm, resp, rm, _ = _batch()
    logits = response_logits(model, prompt, resp, 1, prompt_mask=pm, response_mask=rm)
    for b in range(3):
        p, r = int(pm[b].sum()), int(rm[b].sum())
        ids = torch.cat([prompt[b, :p], resp[b, :r]])[None]
        ref = model(ids).logits[0, p - 1 : p + r - 1]  # hidden state at i-1 predicts token i
        torch.testing.assert_close(logits[b, :r], ref, atol=ATOL, rtol=1e-5)


def test_block_size_above_one_needs_a_noisy_copy() -> None:
    prompt, pm, resp, rm, _ = _batch()
    with pytest.raises(ValueError, match="noisy_response_ids"):
        response_logits(tiny_model(), prompt, resp, K)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@torch.no_grad()
def test_sdpa_eager_and_flex_masks_give_the_same_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    uncompiled_flex_on_cpu(monkeypatch)
    sdpa = tiny_model()
    prompt, pm, resp, rm, noisy = _batch()
    ref = response_logits(sdpa, prompt, resp, K, noisy, pm, rm)
    for attn in ("eager", "flex_attention"):
        out = response_logits(same_weights(sdpa, attn), prompt, resp, K, noisy, pm, rm)
        torch.testing.assert_close(out[rm], ref[rm], atol=ATOL, rtol=1e-5)
