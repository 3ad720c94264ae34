"""The one GRPO/DAPO core, shared by the AR teacher (B = 1) and the block-diffusion policy (DESIGN §6).

Nothing here knows the policy type: log-probabilities come from a callable the caller provides (AR: a
causal forward; diffusion: replay of each token's commit canvas, TraceRL style). Shapes: ``g`` group
size, ``b`` rollouts (= groups x g), ``r`` response length, ``v`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "GRPOBatch",
    "group_advantages",
    "grpo_loss_fn",
    "make_grpo_batch",
    "policy_loss",
    "token_logprobs",
]

LogprobFn = Callable[[torch.nn.Module, Any], torch.Tensor]


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-normalised advantages (R - mean) / (std + eps) and the mask of groups kept.

    rewards [n_groups, g] -> advantages [n_groups, g] float32, keep [n_groups, g] bool. ``std`` is
    the sample standard deviation (as in GRPO/verl). Groups whose rewards are all equal carry no
    learning signal and are dropped (DAPO dynamic sampling): keep False, advantage exactly 0.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    n, g = rewards.shape
    if g < 2:
        raise ValueError("a group needs at least two rollouts")
    mean = rewards.mean(dim=1, keepdim=True)  # [n, 1]
    std = rewards.std(dim=1, keepdim=True)  # [n, 1]
    spread = rewards.amax(dim=1, keepdim=True) - rewards.amin(dim=1, keepdim=True)  # [n, 1]
    keep = (spread > 0).expand(n, g)
    advantages = torch.where(keep, (rewards - mean) / (std + eps), torch.zeros_like(rewards))
    return advantages, keep.clone()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of each token: logits [b, r, v], tokens [b, r] -> [b, r] (float32)."""
    logp = F.log_softmax(logits.float(), dim=-1)  # [b, r, v]
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DAPO clipped policy-gradient loss, normalised over all tokens of the batch.

    new_logprobs, old_logprobs [b, r]; advantages [b]; mask [b, r] bool (response tokens); keep [b]
    optional bool (rows of dropped groups are left out of the sum *and* the token count).
    Per token: -min(ratio A, clip(ratio, 1 - clip_low, 1 + clip_high) A), ratio = exp(new - old).
    Asymmetric clipping ("clip-higher") lets rare tokens gain probability; token-level normalisation
    (sum over tokens / tokens in the batch) stops long rollouts being under-weighted (DAPO §3).
    Metrics: ``clip_fraction`` (tokens where the clipped term is active), ``approx_kl`` (k3 estimator
    of KL(old || new), always >= 0), ``ratio_mean``.
    """
    mask = mask.bool()
    if keep is not None:
        mask = mask & keep.bool().unsqueeze(1)
    adv = advantages.to(new_logprobs.dtype).unsqueeze(1)  # [b, 1]
    # where(), not a product with the mask: padding log-probs may be -inf, and 0 * inf is nan.
    log_ratio = torch.where(mask, new_logprobs - old_logprobs.detach(), torch.zeros_like(new_logprobs))
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)  # [b, r]
    n_tokens = mask.sum().clamp_min(1)
    loss = torch.where(mask, per_token, torch.zeros_like(per_token)).sum() / n_tokens
    with torch.no_grad():
        metrics = {
            "clip_fraction": float(((clipped > unclipped) & mask).sum() / n_tokens),
            "approx_kl": float((((ratio - 1.0) - log_ratio) * mask).sum() / n_tokens),
            "ratio_mean": float((ratio * mask).sum() / n_tokens),
            "tokens": float(mask.sum()),
        }
    return loss, metrics


@dataclass(frozen=True)
class GRPOBatch:
    """One RL batch: rollouts flattened group-major, with what the loss needs besides the policy."""

    inputs: Any  # whatever the caller's log-prob function needs (ids, commit records, ...)
    old_logprobs: torch.Tensor  # [b, r] log-probs at rollout time
    advantages: torch.Tensor  # [b]
    mask: torch.Tensor  # [b, r] bool, response tokens
    keep: torch.Tensor  # [b] bool, rollouts of groups with reward variance


def make_grpo_batch(
    inputs: Any, old_logprobs: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor
) -> GRPOBatch:
    """Assemble a batch from rollouts laid out group-major: rewards [n_groups, g], the rest [b = n g, r]."""
    advantages, keep = group_advantages(rewards)
    return GRPOBatch(inputs, old_logprobs.detach(), advantages.reshape(-1), mask.bool(), keep.reshape(-1))


def grpo_loss_fn(
    logprob_fn: LogprobFn, clip_low: float = 0.2, clip_high: float = 0.28
) -> Callable[[torch.nn.Module, GRPOBatch], tuple[torch.Tensor, dict[str, float]]]:
    """A ``loss_fn(model, batch)`` for the shared loop; ``logprob_fn(model, inputs) -> [b, r]``."""

    def loss_fn(model: torch.nn.Module, batch: GRPOBatch) -> tuple[torch.Tensor, dict[str, float]]:
        new_logprobs = logprob_fn(model, batch.inputs)  # [b, r]
        loss, metrics = policy_loss(
            new_logprobs, batch.old_logprobs, batch.advantages, batch.mask, clip_low, clip_high, batch.keep
        )
        return loss, {**metrics, "kept_fraction": float(batch.keep.float().mean())}

    return loss_fn
