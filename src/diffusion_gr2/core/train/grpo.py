"""The one GRPO/DAPO core, shared by the AR teacher (B = 1) and the block-diffusion policy
(docs/architecture.md#training-stages).

Nothing here knows the policy type: the caller provides ``logits_fn(model, inputs, rows) -> [m, r, v]``,
the logits each token of rollouts ``rows`` was sampled from under the current weights (AR: one causal
forward; diffusion: replay of each token's commit canvas, TraceRL style).

Rollout reuse (PPO; the DAPO and Diffusion-GR2 recipes reuse each rollout batch): a *round* is one
rollout batch, sampled once, whose old log-probs are fixed once, before any update; the round then
trains ``ppo_epochs`` passes of ``mini_batches`` optimiser steps each. The first step's ratio is 1;
every later step sees a policy that has moved, which is where the clip acts.

The old log-probs are the decoder's own (recorded as it sampled; free), or, with
``recompute_old_logprobs``, a no-grad pass of ``logits_fn`` under the sampling weights. Both are the
sampling distribution: in float32 on the CPU they agree to ~5e-7 nats for the AR forward and for
diffusion replay alike (``behaviour_gap`` logs the largest difference when recomputing). The pass
costs about one forward of the round; it pays where decoder and trainer numerics differ (bf16, other
kernels), since only the training forward makes the ratio exactly the policy's change (verl's choice).

Shapes: ``g`` group size, ``b`` rollouts of a round (= groups x g), ``r`` response length, ``v``
vocabulary, ``m`` rollouts of one micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "GRPOBatch",
    "GRPOConfig",
    "GRPORound",
    "LogitsFn",
    "group_advantages",
    "grpo_loss",
    "make_round",
    "policy_loss",
    "reuse_batches",
    "token_entropy",
    "token_logprobs",
]

# logits_fn(model, inputs, rows) -> [m, r', v]: logits of rollouts `rows` (r' = their longest response)
LogitsFn = Callable[[torch.nn.Module, Any, Sequence[int]], torch.Tensor]


@dataclass(frozen=True)
class GRPOConfig:
    """The policy loss and how often each rollout batch is reused."""

    clip_low: float = 0.2  # ratio floor 1 - clip_low
    clip_high: float = 0.28  # ratio ceiling 1 + clip_high (DAPO clip-higher; Diffusion-GR2 uses 0.2)
    ppo_epochs: int = 1  # passes over each rollout batch; 1 = on-policy (ratio always 1)
    mini_batches: int = 4  # optimiser steps per pass; the kept rollouts are split between them
    recompute_old_logprobs: bool = False  # True: a no-grad training forward instead of the decoder's

    def __post_init__(self) -> None:
        if self.ppo_epochs < 1 or self.mini_batches < 1:
            raise ValueError(f"ppo_epochs and mini_batches must be >= 1, got {self}")

    @property
    def updates(self) -> int:
        """Optimiser steps each rollout batch trains."""
        return self.ppo_epochs * self.mini_batches


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


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's distribution: logits [b, r, v] -> [b, r] (float32, nats).

    A logit of ``finfo.min`` (a token a grammar forbids) has probability 0 and contributes 0.
    """
    logp = F.log_softmax(logits.float(), dim=-1)
    return -torch.special.xlogy(logp.exp(), logp.exp()).sum(-1)


def policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    token_norm: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DAPO clipped policy-gradient loss, token-level: sum over tokens / ``token_norm``.

    new_logprobs, old_logprobs [m, r]; advantages [m]; mask [m, r] bool (response tokens).
    Per token: -min(ratio A, clip(ratio, 1 - clip_low, 1 + clip_high) A), ratio = exp(new - old).
    Asymmetric clipping ("clip-higher") lets rare tokens gain probability; token-level normalisation
    (sum over tokens / tokens in the batch) stops long rollouts being under-weighted (DAPO §3).
    ``token_norm`` defaults to the tokens of this batch; a micro-batch of a larger optimiser step
    passes that step's count instead, so the step has one normalisation (see ``reuse_batches``).
    Metrics: ``clip_fraction`` (tokens where the clipped term is active), ``kl_old`` (k3 estimator
    of KL(old || new), always >= 0), ``ratio_mean``, ``tokens``.
    """
    mask = mask.bool()
    adv = advantages.to(new_logprobs.dtype).unsqueeze(1)  # [m, 1]
    # where(), not a product with the mask: padding log-probs may be -inf, and 0 * inf is nan.
    log_ratio = torch.where(mask, new_logprobs - old_logprobs.detach(), torch.zeros_like(new_logprobs))
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)  # [m, r]
    n_tokens = mask.sum().clamp_min(1)
    norm = n_tokens if token_norm is None else max(token_norm, 1e-12)
    loss = torch.where(mask, per_token, torch.zeros_like(per_token)).sum() / norm
    with torch.no_grad():
        metrics = {
            "clip_fraction": float(((clipped > unclipped) & mask).sum() / n_tokens),
            "kl_old": float((((ratio - 1.0) - log_ratio) * mask).sum() / n_tokens),
            "ratio_mean": float((ratio * mask).sum() / n_tokens),
            "tokens": float(mask.sum()),
        }
    return loss, metrics


@dataclass(frozen=True)
class GRPORound:
    """One rollout batch with what every update on it needs; rows laid out group-major."""

    inputs: Any  # what logits_fn reads (the rollouts)
    tokens: torch.Tensor  # [b, r] sampled tokens, right-padded
    old_logprobs: torch.Tensor  # [b, r] under the sampling weights (0 on rows of dropped groups)
    advantages: torch.Tensor  # [b]
    mask: torch.Tensor  # [b, r] bool, response tokens
    keep: torch.Tensor  # [b] bool, rollouts of groups with reward variance
    temperature: float = 1.0  # the rollouts were sampled from softmax(logits / temperature)
    metrics: dict[str, float] = field(default_factory=dict)  # logged with every update on the round


def _scored_logprobs(
    model: torch.nn.Module,
    logits_fn: LogitsFn,
    inputs: Any,
    rows: Sequence[int],
    tokens: torch.Tensor,
    t: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [m, r'] of `tokens` [m, r] under the current weights, and the logits [m, r', v]."""
    logits = logits_fn(model, inputs, rows).float() / t
    return token_logprobs(logits, tokens[:, : logits.shape[1]].to(logits.device)), logits


def make_round(
    model: torch.nn.Module,
    logits_fn: LogitsFn,
    inputs: Any,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    rewards: torch.Tensor,
    temperature: float = 1.0,
    recorded_logprobs: torch.Tensor | None = None,
    metrics: dict[str, float] | None = None,
    recompute: bool = False,
) -> GRPORound:
    """A round from rollouts laid out group-major: rewards [n_groups, g], tokens/mask [b = n g, r].

    ``recorded_logprobs`` [b, r] (the decoder's) are the old log-probs; without them, the kept
    rollouts' old log-probs come from one no-grad pass now, before any update. ``recompute`` does the
    pass anyway and logs ``behaviour_gap``, its largest difference from the recorded ones.
    """
    advantages, keep = group_advantages(rewards)
    keep, mask = keep.reshape(-1), mask.bool()
    rows = torch.nonzero(keep).squeeze(1).tolist()
    extra = {**(metrics or {}), "kept_groups": float(keep.float().mean())}
    if recorded_logprobs is not None and not recompute:
        old = recorded_logprobs.float().cpu()
    else:
        old = torch.zeros(tokens.shape, dtype=torch.float32)
        if rows:
            with torch.no_grad():
                logp, _ = _scored_logprobs(model, logits_fn, inputs, rows, tokens[rows], temperature)
            old[rows, : logp.shape[1]] = logp.cpu()
        if recorded_logprobs is not None and rows:
            gap = (old[rows] - recorded_logprobs[rows]).abs()[mask[rows]]
            extra["behaviour_gap"] = float(gap.max()) if gap.numel() else 0.0
    return GRPORound(inputs, tokens, old, advantages.reshape(-1), mask, keep, temperature, extra)


@dataclass(frozen=True)
class GRPOBatch:
    """One micro-batch: rows of a round, and the normaliser of the optimiser step it belongs to."""

    round: GRPORound
    rows: list[int]  # rollouts of the round in this micro-batch (kept groups only)
    token_norm: float  # tokens of the whole optimiser step / its shares (the loop divides by as many)
    epoch: int  # 0-based pass over the round


def _split_rows(
    keep: torch.Tensor, config: GRPOConfig, seed: int, round_id: int, epoch: int
) -> list[list[int]]:
    """Kept rollouts shuffled for `epoch`: [mini-batch] -> row indices."""
    kept = torch.nonzero(keep).squeeze(1).numpy()
    order = np.random.default_rng([seed, round_id, epoch]).permutation(kept)
    return [mini.tolist() for mini in np.array_split(order, config.mini_batches)]


SampleShare = Callable[[int, int, int, torch.nn.Module], GRPORound]


def reuse_batches(
    sample_share: SampleShare,
    config: GRPOConfig,
    grad_accum: int = 1,
    num_processes: int = 1,
    seed: int = 0,
    sum_over_processes: Callable[[float], float] = float,
) -> Callable[[int, torch.nn.Module], GRPOBatch]:
    """``make_batch`` for the shared loop: every rollout batch trains ``config.updates`` optimiser steps.

    A step's rollout batch is split into ``grad_accum x num_processes`` shares, one per micro-batch
    slot of the step: the loop's micro-batch index is ``(step * grad_accum + micro) * num_processes +
    process``, and its slot ``index % shares``. ``sample_share(round_no, share, shares, model)`` samples
    share ``share`` of rollout batch ``round_no`` with the current weights, each from its own requests
    and seed, so the rollouts, their groups and the gradient are the same however the shares are laid
    out: two processes give what one process with ``grad_accum: 2`` gives. A process samples all its
    shares of a round at the round's first micro-batch and keeps them until the next round; a run
    resumed in the middle of a round cannot rebuild it (the weights that sampled it are gone), so
    checkpoints must fall on round boundaries. Each update takes one mini-batch of every share,
    normalised by the tokens of the whole step (``sum_over_processes`` adds the other processes'
    counts: DAPO's token-level mean over the step, not a mean of per-share means).
    """
    shares = grad_accum * num_processes
    held: dict[int, GRPORound] = {}  # share -> its rollouts, for the current round only
    norms: dict[int, float] = {}  # update -> the step's token count over every share
    current = [-1]

    def rows_of(share: int, round_no: int, epoch: int, mini: int) -> list[int]:
        return _split_rows(held[share].keep, config, seed, round_no * shares + share, epoch)[mini]

    def make_batch(index: int, model: torch.nn.Module) -> GRPOBatch:
        step, share = divmod(index, shares)
        micro, process = divmod(share, num_processes)
        round_no, update = divmod(step, config.updates)
        epoch, mini = divmod(update, config.mini_batches)
        if current[0] != round_no:
            if update or micro:
                raise RuntimeError(
                    f"rollout batch {round_no} must be sampled at its first update, not at update {update} "
                    f"(micro-batch {micro}): resume only from checkpoints at multiples of {config.updates} steps"
                )
            held.clear()
            norms.clear()
            current[0] = round_no
            for mine in range(process, shares, num_processes):  # this process's slots
                held[mine] = sample_share(round_no, mine, shares, model)
        if update not in norms:  # at micro-batch 0 of the update, on every process at once
            local = sum(float(held[s].mask[rows_of(s, round_no, epoch, mini)].sum()) for s in held)
            norms[update] = sum_over_processes(local)
        return GRPOBatch(held[share], rows_of(share, round_no, epoch, mini), norms[update] / shares, epoch)

    return make_batch


def grpo_loss(logits_fn: LogitsFn, config: GRPOConfig) -> Callable:
    """``loss_fn(model, batch: GRPOBatch)`` for the shared loop: the one GRPO/DAPO policy loss."""

    def loss_fn(model: torch.nn.Module, batch: GRPOBatch) -> tuple[torch.Tensor, dict[str, float]]:
        rnd = batch.round
        extra = {**rnd.metrics, "ppo_epoch": float(batch.epoch)}
        if not batch.rows:
            # No kept rollout in this micro-batch (zero reward variance everywhere, or fewer kept
            # rollouts than micro-batches): the loss is an exact zero, still computed through one
            # rollout's forward, so that every process runs the same modules: FSDP reduce-scatters a
            # unit's gradient where its backward ends, and a process without a forward would issue
            # them in another order than the others (core/train/fsdp.py).
            new, _ = _scored_logprobs(model, logits_fn, rnd.inputs, [0], rnd.tokens[[0]], rnd.temperature)
            zero = torch.where(rnd.mask[[0], : new.shape[1]].to(new.device), new, 0.0).sum() * 0.0
            return zero, {**extra, "clip_fraction": 0.0, "kl_old": 0.0, "ratio_mean": 1.0, "tokens": 0.0}
        rows = batch.rows
        new, logits = _scored_logprobs(model, logits_fn, rnd.inputs, rows, rnd.tokens[rows], rnd.temperature)
        r, dev = new.shape[1], new.device
        mask = rnd.mask[rows, :r].to(dev)
        loss, metrics = policy_loss(
            new,
            rnd.old_logprobs[rows, :r].to(dev),
            rnd.advantages[rows].to(dev),
            mask,
            config.clip_low,
            config.clip_high,
            batch.token_norm,
        )
        with torch.no_grad():
            entropy = float(token_entropy(logits)[mask].mean())
        return loss, {**extra, **metrics, "entropy": entropy}

    return loss_fn
