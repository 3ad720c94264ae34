"""GRPO/DAPO core: vectorised maths against plain loops, and one real policy update on a tiny model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from diffusion_gr2.core.train.grpo import (
    group_advantages,
    grpo_loss_fn,
    make_grpo_batch,
    policy_loss,
    token_logprobs,
)
from diffusion_gr2.core.train.loop import TrainConfig, train

torch.set_num_threads(1)


def test_group_advantages_match_loop_and_drop_flat_groups() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.5, -1.0], [0.3, 0.3, 0.3, 0.3], [-1.0, 0.2, 0.2, 0.2]])
    adv, keep = group_advantages(rewards)
    for i, row in enumerate(rewards.tolist()):
        mean = sum(row) / len(row)
        std = math.sqrt(sum((x - mean) ** 2 for x in row) / (len(row) - 1))
        for j, x in enumerate(row):
            expected = 0.0 if std == 0 else (x - mean) / (std + 1e-6)
            assert adv[i, j].item() == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert keep.tolist() == [[True] * 4, [False] * 4, [True] * 4]
    assert torch.all(adv[1] == 0)
    assert adv[0].sum().item() == pytest.approx(0.0, abs=1e-5)


def _loop_policy_loss(new, old, adv, mask, lo, hi):
    total, n, clipped, kl, ratio_sum = 0.0, 0, 0, 0.0, 0.0
    for i in range(len(new)):
        for j in range(len(new[0])):
            if not mask[i, j]:
                continue
            ratio = math.exp(new[i][j] - old[i][j])
            a = adv[i]
            unclipped, clip = -a * ratio, -a * min(max(ratio, 1 - lo), 1 + hi)
            total += max(unclipped, clip)
            clipped += clip > unclipped
            kl += (ratio - 1) - math.log(ratio)
            ratio_sum += ratio
            n += 1
    return total / n, clipped / n, kl / n, ratio_sum / n


def test_policy_loss_matches_loop_reference() -> None:
    g = torch.Generator().manual_seed(0)
    b, r = 6, 9
    old = -torch.rand(b, r, generator=g) * 3
    new = old + torch.randn(b, r, generator=g) * 0.4  # ratios well outside [0.8, 1.28] on both sides
    adv = torch.randn(b, generator=g)
    mask = torch.rand(b, r, generator=g) < 0.8
    loss, metrics = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28)
    ref_loss, ref_clip, ref_kl, ref_ratio = _loop_policy_loss(
        new.tolist(), old.tolist(), adv.tolist(), mask, 0.2, 0.28
    )
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
    assert metrics["clip_fraction"] == pytest.approx(ref_clip) and 0 < ref_clip < 1
    assert metrics["approx_kl"] == pytest.approx(ref_kl, rel=1e-4)
    assert metrics["ratio_mean"] == pytest.approx(ref_ratio, rel=1e-5)


def test_policy_loss_is_token_level_and_keep_leaves_rows_out() -> None:
    new = torch.zeros(2, 4, requires_grad=True)
    adv = torch.tensor([1.0, -3.0])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    loss, _ = policy_loss(new, new.detach(), adv, mask)
    assert loss.item() == pytest.approx((4 * -1.0 + 1 * 3.0) / 5)  # sum over tokens / all tokens
    kept, _ = policy_loss(new, new.detach(), adv, mask, keep=torch.tensor([True, False]))
    kept.backward()
    assert kept.item() == pytest.approx(-1.0) and torch.all(new.grad[1] == 0)


def _tiny_policy(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=32,
    )  # fmt: skip
    return Qwen3ForCausalLM(cfg)


PROMPT = torch.tensor([[1, 2, 3]])


def _ar_logprobs(model: torch.nn.Module, rollouts: torch.Tensor) -> torch.Tensor:
    """AR policy: one causal forward over prompt + rollout; rollouts [b, r] -> log-probs [b, r]."""
    b, r = rollouts.shape
    ids = torch.cat([PROMPT.expand(b, -1), rollouts], dim=1)  # [b, p + r]
    logits = model(input_ids=ids).logits[:, PROMPT.shape[1] - 1 : -1]  # token shift: [b, r, v]
    return token_logprobs(logits, rollouts)


ROLLOUTS = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16], [17, 18, 19, 20]])


def test_grpo_steps_raise_best_and_lower_worst_rollout(tmp_path: Path) -> None:
    model = _tiny_policy()
    rewards = torch.tensor([[1.0, 0.3, -0.2, -1.0]])  # rollout 0 best, rollout 3 worst (invalid)
    mask = torch.ones_like(ROLLOUTS, dtype=torch.bool)

    def make_batch(index: int, policy: torch.nn.Module):
        with torch.no_grad():  # on-policy: old log-probs from the current weights
            old = _ar_logprobs(policy, ROLLOUTS)
        return make_grpo_batch(ROLLOUTS, old, rewards, mask)

    with torch.no_grad():
        before = _ar_logprobs(model, ROLLOUTS).sum(dim=1)
    cfg = TrainConfig(
        output_dir=str(tmp_path), lr=5e-3, max_steps=3, checkpoint_every=0, cpu=True, progress=False
    )
    result = train(model, make_batch, grpo_loss_fn(_ar_logprobs), cfg)
    with torch.no_grad():
        after = _ar_logprobs(model, ROLLOUTS).sum(dim=1)
    assert after[0] > before[0] and after[3] < before[3]
    assert result.history[0]["ratio_mean"] == pytest.approx(1.0) and result.history[0]["kept_fraction"] == 1.0


def _grads(model: torch.nn.Module, batch) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=False)
    loss, _ = grpo_loss_fn(_ar_logprobs)(model, batch)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_zero_variance_groups_contribute_no_gradient() -> None:
    model = _tiny_policy(1)
    with torch.no_grad():
        old = _ar_logprobs(model, ROLLOUTS)
    mask = torch.ones_like(ROLLOUTS, dtype=torch.bool)
    flat = make_grpo_batch(ROLLOUTS, old, torch.tensor([[0.5, 0.5], [-1.0, -1.0]]), mask)
    assert not flat.keep.any()
    assert all(torch.all(g == 0) for g in _grads(model, flat))
    # A mixed batch: group 2 (flat) changes neither the gradient nor the token count of group 1.
    mixed = make_grpo_batch(ROLLOUTS, old, torch.tensor([[1.0, 0.0], [0.2, 0.2]]), mask)
    alone = make_grpo_batch(ROLLOUTS[:2], old[:2], torch.tensor([[1.0, 0.0]]), mask[:2])
    for gm, ga in zip(_grads(model, mixed), _grads(model, alone), strict=True):
        torch.testing.assert_close(gm, ga)
    assert any(torch.any(g != 0) for g in _grads(model, alone))
