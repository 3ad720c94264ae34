"""SFT/CFT/OPD losses against plain-loop references and their structural invariants."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from diffusion_gr2.core.train.losses import cft_noise, forward_kl, pad_to_blocks, weighted_token_ce

torch.set_num_threads(1)
MASK = 99


def _random_case(seed: int = 0, b: int = 3, r: int = 7, v: int = 11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, r, v, generator=g)
    targets = torch.randint(0, v, (b, r), generator=g)
    roles = torch.randint(0, 2, (b, r), generator=g)
    mask = torch.rand(b, r, generator=g) < 0.7
    return logits, targets, roles, mask


def test_weighted_ce_matches_loop_reference() -> None:
    logits, targets, roles, mask = _random_case()
    loss, metrics = weighted_token_ce(logits, targets, roles, mask, lambda_r=0.3, lambda_o=2.0)
    num = den = 0.0
    for i in range(logits.shape[0]):
        for j in range(logits.shape[1]):
            if mask[i, j]:
                w = 2.0 if roles[i, j] == 1 else 0.3
                ce = -torch.log_softmax(logits[i, j], dim=-1)[targets[i, j]].item()
                num, den = num + w * ce, den + w
    assert loss.item() == pytest.approx(num / den, rel=1e-5)
    assert metrics["tokens"] == float(mask.sum())


def test_weighted_ce_equal_weights_is_plain_masked_ce_and_ignores_unmasked() -> None:
    logits, targets, roles, mask = _random_case(1)
    logits.requires_grad_(True)
    loss, _ = weighted_token_ce(logits, targets, roles, mask, lambda_r=1.7, lambda_o=1.7)
    ref = F.cross_entropy(logits[mask], targets[mask])
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    loss.backward()
    assert torch.all(logits.grad[~mask] == 0)
    only_answer, m = weighted_token_ce(logits, targets, roles, mask, lambda_r=0.0, lambda_o=1.0)
    assert only_answer.item() == pytest.approx(m["ce_answer"], rel=1e-5)


def test_weighted_ce_empty_mask_is_zero_and_differentiable() -> None:
    logits, targets, roles, mask = _random_case(2)
    logits.requires_grad_(True)
    loss, _ = weighted_token_ce(logits, targets, roles, torch.zeros_like(mask))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(logits.grad == 0)


def test_weighted_ce_reports_only_the_roles_present() -> None:
    logits, targets, roles, mask = _random_case(2)
    _, answer_only = weighted_token_ce(logits, targets, torch.ones_like(roles), mask)
    assert "ce_answer" in answer_only and "ce_reasoning" not in answer_only  # no NaN entry
    _, both = weighted_token_ce(logits, targets, roles, mask)
    assert all(math.isfinite(v) for v in both.values()) and {"ce_answer", "ce_reasoning"} <= set(both)


def _response(b: int = 4, r: int = 16, pad_from: int = 13) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 50, (b, r), generator=torch.Generator().manual_seed(3))
    roles = (torch.arange(r) >= 8).long().expand(b, r).clone()
    ids[1, pad_from:] = MASK  # row 1 is shorter: padded with mask tokens
    roles[1, pad_from:] = -1
    return ids, roles


def test_cft_views_are_complementary_and_cover_every_real_token_once() -> None:
    ids, roles = _response()
    noise = cft_noise(
        ids, roles, block_size=4, mask_token_id=MASK, eps=0.1, generator=torch.Generator().manual_seed(0)
    )
    real = (ids != MASK) & (roles >= 0)
    assert not (noise.loss_a & noise.loss_b).any()
    assert torch.equal(noise.loss_a | noise.loss_b, real)  # each real token supervised exactly once
    masked_a, masked_b = (noise.noisy_a == MASK) & real, (noise.noisy_b == MASK) & real
    assert not (masked_a & masked_b).any()
    block_first = torch.arange(16) % 4 == 0
    # a block's first position is masked like the others (the fused forward's canvas) ...
    assert (masked_a | masked_b)[:, block_first].any()
    assert torch.equal(masked_a | masked_b, real)
    # ... but always supervised once, in view a (its prediction comes from the clean copy)
    assert torch.equal(noise.loss_a, (masked_a & ~block_first) | (real & block_first))
    assert torch.equal(noise.loss_b, masked_b & ~block_first)
    # Unmasked positions keep their ids; padding stays the mask token and is never supervised.
    assert torch.equal(noise.noisy_a[~masked_a], ids[~masked_a])
    assert not noise.loss_a[1, 13:].any() and not noise.loss_b[1, 13:].any()


def test_cft_masking_rate_follows_per_block_noise_level() -> None:
    b, r, k = 400, 32, 8
    ids, roles = torch.ones(b, r, dtype=torch.long), torch.zeros(b, r, dtype=torch.long)
    noise = cft_noise(ids, roles, k, MASK, eps=0.0, generator=torch.Generator().manual_seed(1))
    frac = (noise.noisy_a == MASK).view(b, r // k, k)[..., 1:].float().mean(-1)  # [b, blocks]
    assert frac.mean().item() == pytest.approx(0.5, abs=0.03)  # E[t] with t ~ U(0, 1)
    assert frac.std().item() > 0.2  # levels differ per block (uniform t has std 0.29)
    full = cft_noise(ids, roles, k, MASK, eps=1.0)  # eps = 1: every maskable position in view a
    assert (full.noisy_a == MASK).all() and not (full.noisy_b == MASK).any()  # the fused first canvas


def test_cft_suffix_noise_masks_a_suffix_of_every_block() -> None:
    """The `prefix` decoder's canvases: a committed prefix, then masks to the end of the block."""
    b, r, k = 300, 32, 8
    ids, roles = torch.ones(b, r, dtype=torch.long), torch.zeros(b, r, dtype=torch.long)
    noise = cft_noise(ids, roles, k, MASK, generator=torch.Generator().manual_seed(2), pattern="suffix")
    for noisy in (noise.noisy_a, noise.noisy_b):
        masked = (noisy == MASK).view(b, r // k, k)
        assert masked[..., -1].all()  # at least the block's last position: a step has work
        assert not (masked[..., :-1] & ~masked[..., 1:]).any()  # never a clean token right of a mask
        starts = k - masked.sum(-1)  # [b, blocks]: the first masked position
        counts = torch.bincount(starts.flatten(), minlength=k)
        assert (counts > 0).all() and counts.max() < 2 * counts.min()  # L uniform over 0..k-1
    assert not torch.equal(noise.noisy_a, noise.noisy_b)  # each view draws its own suffix
    block_first = torch.arange(r) % k == 0
    assert torch.equal(noise.loss_a, ((noise.noisy_a == MASK) & ~block_first) | block_first)
    assert torch.equal(noise.loss_b, (noise.noisy_b == MASK) & ~block_first)
    ids, roles = _response()
    short = cft_noise(ids, roles, 4, MASK, generator=torch.Generator().manual_seed(0), pattern="suffix")
    assert not short.loss_a[1, 13:].any() and not short.loss_b[1, 13:].any()  # padding: never a loss
    with pytest.raises(ValueError, match="pattern"):
        cft_noise(ids, roles, 4, MASK, pattern="random")


def test_cft_block_size_one_is_the_ar_loss_and_seeded() -> None:
    ids, roles = _response()
    ar = cft_noise(ids, roles, 1, MASK, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ar.noisy_a, ids) and torch.equal(ar.loss_a, (ids != MASK) & (roles >= 0))
    assert not ar.loss_b.any()
    one = cft_noise(ids, roles, 4, MASK, generator=torch.Generator().manual_seed(5))
    two = cft_noise(ids, roles, 4, MASK, generator=torch.Generator().manual_seed(5))
    assert all(torch.equal(x, y) for x, y in zip(one, two, strict=True))
    with pytest.raises(ValueError, match="multiple"):
        cft_noise(ids[:, :15], roles[:, :15], 4, MASK)


def test_pad_to_blocks() -> None:
    ids, roles = torch.arange(10).view(2, 5), torch.ones(2, 5, dtype=torch.long)
    pids, proles = pad_to_blocks(ids, roles, 4, MASK)
    assert pids.shape == (2, 8) and torch.all(pids[:, 5:] == MASK) and torch.all(proles[:, 5:] == -1)
    same, _ = pad_to_blocks(pids, proles, 4, MASK)
    assert same is pids


def test_forward_kl_reference_zero_and_mask() -> None:
    logits, _, _, mask = _random_case(4)
    student = torch.randn_like(logits).requires_grad_(True)
    teacher = logits.clone().requires_grad_(True)
    loss, metrics = forward_kl(teacher, student, mask)
    ref = F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True, reduction="none")
    assert loss.item() == pytest.approx(ref.sum(-1)[mask].mean().item(), rel=1e-5)
    assert loss.item() > 0 and 0.0 <= metrics["top1_agreement"] <= 1.0
    loss.backward()
    assert teacher.grad is None and torch.all(student.grad[~mask] == 0)
    same, m = forward_kl(logits, logits.clone(), mask)
    assert same.item() == pytest.approx(0.0, abs=1e-6) and m["top1_agreement"] == 1.0
    changed = student.detach().clone()
    changed[~mask] += 5.0  # tokens outside the mask do not matter
    assert forward_kl(teacher, changed, mask)[0].item() == pytest.approx(loss.item(), rel=1e-6)


def test_forward_kl_teacher_with_impossible_tokens_is_finite() -> None:
    teacher = torch.tensor([[[0.0, 1.0, -math.inf]]])
    student = torch.tensor([[[0.5, 0.5, 0.0]]])
    loss, _ = forward_kl(teacher, student, torch.ones(1, 1, dtype=torch.bool))
    assert math.isfinite(loss.item()) and loss.item() > 0
