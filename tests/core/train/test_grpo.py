"""GRPO/DAPO core: vectorised maths against plain loops, rollout reuse, and real updates on a tiny model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from diffusion_gr2.core.train.grpo import (
    GRPOBatch,
    GRPOConfig,
    group_advantages,
    grpo_loss,
    make_round,
    policy_loss,
    reuse_batches,
    token_entropy,
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
    assert metrics["kl_old"] == pytest.approx(ref_kl, rel=1e-4)
    assert metrics["ratio_mean"] == pytest.approx(ref_ratio, rel=1e-5)


def test_policy_loss_is_token_level_with_an_optional_step_normaliser() -> None:
    new = torch.zeros(2, 4, requires_grad=True)
    adv = torch.tensor([1.0, -3.0])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    loss, _ = policy_loss(new, new.detach(), adv, mask)
    assert loss.item() == pytest.approx((4 * -1.0 + 1 * 3.0) / 5)  # sum over tokens / all tokens
    step, _ = policy_loss(new, new.detach(), adv, mask, token_norm=10.0)  # a micro-batch of a larger step
    assert step.item() == pytest.approx((4 * -1.0 + 1 * 3.0) / 10)


def test_token_entropy_matches_loop_and_ignores_forbidden_tokens() -> None:
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    ent = token_entropy(logits)
    for i in range(2):
        for j in range(3):
            p = torch.softmax(logits[i, j].double(), -1).tolist()
            assert ent[i, j].item() == pytest.approx(-sum(q * math.log(q) for q in p), rel=1e-5)
    forbidden = logits.clone()
    forbidden[..., 3:] = torch.finfo(torch.float32).min  # a grammar's mask: the renormalised rest
    torch.testing.assert_close(token_entropy(forbidden), token_entropy(logits[..., :3]))


def _tiny_policy(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=32,
    )  # fmt: skip
    return Qwen3ForCausalLM(cfg)


PROMPT = torch.tensor([[1, 2, 3]])
# two groups of four rollouts (group-major), tokens 4..23 of the tiny vocabulary
ROLLOUTS = torch.arange(4, 24).view(5, 4).repeat(2, 1)[:8]
MASK = torch.ones_like(ROLLOUTS, dtype=torch.bool)


def _ar_logits(model: torch.nn.Module, rollouts: torch.Tensor, rows) -> torch.Tensor:
    """AR policy: one causal forward over prompt + rollout; rows of rollouts [b, r] -> logits [m, r, v]."""
    picked = rollouts[list(rows)]  # [m, r]
    ids = torch.cat([PROMPT.expand(len(picked), -1), picked], dim=1)  # [m, p + r]
    return model(input_ids=ids).logits[:, PROMPT.shape[1] - 1 : -1]  # token shift: [m, r, v]


def _ar_logprobs(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(_ar_logits(model, ROLLOUTS, range(len(ROLLOUTS))), ROLLOUTS)  # [b, r]


def _rounds(rewards: torch.Tensor):
    """``sample_share`` that scores the fixed rollouts with ``rewards`` [2, 4], and the (round, share)
    pairs it was asked for."""
    asked: list[tuple[int, int]] = []

    def sample_round(round_no: int, share: int, shares: int, model: torch.nn.Module):
        asked.append((round_no, share))
        return make_round(model, _ar_logits, ROLLOUTS, ROLLOUTS, MASK, rewards)

    return sample_round, asked


REWARDS = torch.tensor([[1.0, 0.3, -0.2, -1.0], [0.5, 0.0, 0.0, -1.0]])  # rollout 0 best, 3 worst


def test_reused_rollouts_move_the_ratio_and_the_clip_acts(tmp_path: Path) -> None:
    model = _tiny_policy()
    sample_round, asked = _rounds(REWARDS)
    config = GRPOConfig(clip_low=0.2, clip_high=0.28, ppo_epochs=4, mini_batches=2)
    before = _ar_logprobs(model).sum(dim=1)
    cfg = TrainConfig(
        output_dir=str(tmp_path), lr=2e-2, max_steps=8, checkpoint_every=0, cpu=True, progress=False
    )
    history = train(model, reuse_batches(sample_round, config), grpo_loss(_ar_logits, config), cfg).history
    after = _ar_logprobs(model).sum(dim=1)
    assert asked == [(0, 0)]  # one rollout batch, sampled once, trained 4 epochs x 2 mini-batches
    first, later = history[0], history[1:]
    # The first update is on-policy: the ratio is 1 (same forward as the old log-probs), nothing clips.
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert first["clip_fraction"] == 0.0 and first["kl_old"] == pytest.approx(0.0, abs=1e-9)
    assert all(h["kl_old"] > 0 for h in later) and max(h["clip_fraction"] for h in later) > 0
    assert [h["ppo_epoch"] for h in history] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(h["entropy"] > 0 for h in history)
    assert after[0] > before[0] and after[3] < before[3]


def test_schedule_splits_each_round_over_updates_and_shares() -> None:
    model = _tiny_policy()
    rewards = torch.tensor([[1.0, 0.3, -0.2, -1.0], [0.5, 0.5, 0.5, 0.5]])  # group 2 is dropped
    sample_round, asked = _rounds(rewards)
    config = GRPOConfig(ppo_epochs=2, mini_batches=2)
    accum, processes, process = 2, 3, 1
    make_batch = reuse_batches(sample_round, config, grad_accum=accum, num_processes=processes)
    # process 1's micro-batches of two rounds: (step * accum + micro) * processes + process
    batches = [
        make_batch((s * accum + m) * processes + process, model) for s in range(8) for m in range(accum)
    ]
    # each round is 6 shares (2 micro-batches x 3 processes); process 1 holds shares 1 and 4
    assert asked == [(0, 1), (0, 4), (1, 1), (1, 4)]
    per_step = [batches[i : i + accum] for i in range(0, len(batches), accum)]
    for step, (a, b) in enumerate(per_step):
        # one normaliser for the step (no other process here: its own shares' tokens), per share
        assert (
            a.epoch == step % 4 // 2 and a.token_norm == b.token_norm == (len(a.rows) + len(b.rows)) * 4 / 6
        )
    for epoch in range(4):  # every kept rollout of each share once per epoch, over its two mini-batches
        for micro in range(accum):
            rows = sorted(r for b in batches[4 * epoch + micro : 4 * epoch + 4 : accum] for r in b.rows)
            assert rows == [0, 1, 2, 3]
    fresh = reuse_batches(sample_round, config, grad_accum=accum)
    with pytest.raises(RuntimeError, match="first update"):
        fresh(2 * accum, model)  # step 2: a resume inside round 0 cannot rebuild it


def test_shares_are_the_same_whatever_the_split_between_processes_and_accumulation() -> None:
    """Two processes (grad_accum 1) see exactly the batches one process sees with grad_accum 2."""
    model = _tiny_policy()
    lengths = torch.tensor([4, 1, 3, 2, 4, 2, 1, 4])
    mask = torch.arange(4)[None, :] < lengths[:, None]
    config = GRPOConfig(ppo_epochs=1, mini_batches=2)

    def sample_share(round_no: int, share: int, shares: int, policy: torch.nn.Module):
        rewards = torch.tensor([[1.0, 0.3, -0.2, -1.0], [0.5, 0.0, 0.2, -1.0]]) * (1 + share + round_no)
        return make_round(policy, _ar_logits, ROLLOUTS, ROLLOUTS, mask if share else ~mask, rewards)

    one = reuse_batches(sample_share, config, grad_accum=2)
    whole = [one(i, model) for i in range(4)]  # 2 steps x 2 micro-batches
    counts: dict[int, float] = {}  # each process's own token count at its latest update

    def sums(process: int):  # the other process's count, as the all-reduce would add it
        return lambda value: value + counts.get(1 - process, 0.0)

    two = [reuse_batches(sample_share, config, num_processes=2, sum_over_processes=sums(p)) for p in (0, 1)]
    split = []
    for i in range(4):  # the two processes' micro-batches in step order
        batch = two[i % 2](i, model)
        counts[i % 2] = float(batch.round.mask[batch.rows].sum())
        split.append((i, batch))
    by_index = dict(split)
    for i, batch in enumerate(whole):
        assert by_index[i].rows == batch.rows and torch.equal(by_index[i].round.mask, batch.round.mask)
    # process 1 ran second, so its normaliser saw both counts: the one-process step's normaliser
    assert by_index[1].token_norm == whole[1].token_norm and by_index[3].token_norm == whole[3].token_norm


def _grads(model: torch.nn.Module, batches: list[GRPOBatch], config: GRPOConfig) -> list[torch.Tensor]:
    """Gradients of one optimiser step over `batches` as the loop takes it (each loss / grad_accum)."""
    model.zero_grad(set_to_none=False)
    for batch in batches:
        loss, _ = grpo_loss(_ar_logits, config)(model, batch)
        (loss / len(batches)).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_grad_accum_keeps_one_token_normalisation_over_the_step() -> None:
    """Shares of unequal token counts: the step's gradient is the token-level mean over all of them."""
    model = _tiny_policy(1)
    lengths = torch.tensor([4, 1, 3, 2, 4, 2, 1, 4])  # 21 tokens in share 0, 11 in share 1
    masks = [torch.arange(4)[None, :] < lengths[:, None], torch.arange(4)[None, :] < (lengths[:, None] // 2)]
    config = GRPOConfig(mini_batches=1)  # one step per rollout batch

    def sample_share(round_no: int, share: int, shares: int, policy: torch.nn.Module):
        return make_round(policy, _ar_logits, ROLLOUTS, ROLLOUTS, masks[share], REWARDS)

    split = reuse_batches(sample_share, config, grad_accum=2)
    parts = [split(0, model), split(1, model)]
    total = float(masks[0].sum() + masks[1].sum())
    assert parts[0].token_norm == parts[1].token_norm == total / 2

    # the same step by hand: every token of both shares, summed, over the step's token count
    model.zero_grad(set_to_none=False)
    for part in parts:
        new = token_logprobs(_ar_logits(model, ROLLOUTS, part.rows), ROLLOUTS[part.rows])
        loss, _ = policy_loss(
            new, part.round.old_logprobs[part.rows], part.round.advantages[part.rows],
            part.round.mask[part.rows], config.clip_low, config.clip_high, token_norm=total,
        )  # fmt: skip
        loss.backward()
    by_hand = [p.grad.clone() for p in model.parameters()]
    for g_split, g_hand in zip(_grads(model, parts, config), by_hand, strict=True):
        torch.testing.assert_close(g_split, g_hand, atol=1e-7, rtol=1e-5)


def test_zero_variance_groups_contribute_no_gradient() -> None:
    model = _tiny_policy(1)
    config = GRPOConfig(mini_batches=1)  # one step per rollout batch

    def batch_of(rewards: torch.Tensor, rows: int = 8) -> GRPOBatch:
        rnd = make_round(model, _ar_logits, ROLLOUTS[:rows], ROLLOUTS[:rows], MASK[:rows], rewards)
        return reuse_batches(lambda r, s, n, m: rnd, config)(0, model)

    flat = batch_of(torch.tensor([[0.5, 0.5, 0.5, 0.5], [-1.0, -1.0, -1.0, -1.0]]))
    assert flat.rows == [] and flat.round.metrics["kept_groups"] == 0.0
    assert all(torch.all(g == 0) for g in _grads(model, [flat], config))
    # A mixed batch: group 2 (flat) changes neither the gradient nor the token count of group 1.
    mixed = batch_of(torch.tensor([[1.0, 0.0, 0.2, 0.1], [0.2, 0.2, 0.2, 0.2]]))
    alone = batch_of(torch.tensor([[1.0, 0.0, 0.2, 0.1]]), rows=4)
    assert sorted(mixed.rows) == [0, 1, 2, 3] and mixed.token_norm == alone.token_norm == 16
    for gm, ga in zip(_grads(model, [mixed], config), _grads(model, [alone], config), strict=True):
        torch.testing.assert_close(gm, ga)
    assert any(torch.any(g != 0) for g in _grads(model, [alone], config))
