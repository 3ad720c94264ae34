"""Token losses for SFT, CFT and OPD as pure functions returning ``(loss, metrics)``
(docs/architecture.md#training-stages).

Shapes: ``b`` batch, ``r`` response length, ``v`` vocabulary, ``k`` block size. Logits are always
aligned with the response tokens (``logits[:, j]`` predicts ``response_ids[:, j]``, the token shift
already applied by ``model/diffusion.py: response_logits``). Losses are computed in float32 whatever
the model dtype, so bf16 logits do not lose the small probabilities the KL and CE depend on.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

NOISE_PATTERNS = ("complementary", "suffix", "trajectory")

__all__ = [
    "NOISE_PATTERNS",
    "CFTNoise",
    "certainty_penalty",
    "cft_noise",
    "forward_kl",
    "pad_to_blocks",
    "weighted_token_ce",
]

REASONING, ANSWER, PADDING = 0, 1, -1  # response roles (core/text/tokenizer.py: encode_example)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of ``values`` over ``mask`` as a float (nan when the mask is empty)."""
    n = int(mask.sum())
    return float((values * mask).sum() / n) if n else float("nan")


def weighted_token_ce(
    logits: torch.Tensor,
    targets: torch.Tensor,
    roles: torch.Tensor,
    loss_mask: torch.Tensor,
    lambda_r: float = 1.0,
    lambda_o: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy with reasoning tokens weighted ``lambda_r`` and answer tokens ``lambda_o`` (GR2 SFT).

    logits [b, r, v], targets [b, r] token ids, roles [b, r] (0 reasoning, 1 answer), loss_mask [b, r]
    bool. Loss = sum_j w_j CE_j / sum_j w_j over masked positions, so the weights change the balance
    between the two parts, not the loss scale. An empty mask gives 0 (still differentiable).
    """
    b, r, v = logits.shape
    mask = loss_mask.bool()
    safe_targets = torch.where(mask, targets, torch.zeros_like(targets))  # ids off the mask may be anything
    ce = F.cross_entropy(logits.float().reshape(b * r, v), safe_targets.reshape(b * r), reduction="none")
    ce = ce.view(b, r)  # [b, r]
    is_answer = roles == ANSWER
    weights = torch.where(is_answer, lambda_o, lambda_r).to(ce.dtype) * mask  # [b, r]
    loss = (ce * weights).sum() / weights.sum().clamp_min(1e-12)
    with torch.no_grad():
        correct = (logits.argmax(dim=-1) == targets).float()
        # A role with no tokens in the batch (the copy task has no reasoning) gets no entry rather
        # than NaN: the loop averages each metric over the steps that have it, and JSON stays valid.
        parts = {"ce_reasoning": mask & ~is_answer, "ce_answer": mask & is_answer}
        metrics = {name: _masked_mean(ce, m) for name, m in parts.items() if m.any()}
        metrics |= {"token_accuracy": _masked_mean(correct, mask), "tokens": float(mask.sum())}
    return loss, metrics


def certainty_penalty(
    logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean entropy of the positions in ``loss_mask`` whose arg-max is already the target (dParallel).

    Certainty forcing: a position the model already gets right but below tau stops a step's run of
    commits; lowering its entropy lets it clear tau in an earlier forward. Wrong positions are left to
    the cross-entropy (sharpening a wrong guess would make it commit the error sooner).
    logits [b, r, v], targets [b, r], loss_mask [b, r] bool. An empty set gives 0 (differentiable).
    """
    logp = F.log_softmax(logits.float(), dim=-1)  # [b, r, v]
    entropy = -(logp.exp() * logp).sum(-1)  # [b, r]
    correct = loss_mask.bool() & (logits.argmax(dim=-1) == targets)
    n = correct.sum()
    loss = (entropy * correct).sum() / n.clamp_min(1)
    with torch.no_grad():
        confident = logp.max(-1).values.exp()  # [b, r]
        metrics = {
            "certainty_entropy": float(loss),
            "correct_share": float(n / loss_mask.sum().clamp_min(1)),
            "correct_confidence": _masked_mean(confident, correct),
        }
    return loss, metrics


def pad_to_blocks(
    response_ids: torch.Tensor, roles: torch.Tensor, block_size: int, mask_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad responses [b, r] to a multiple of ``block_size`` with mask tokens (role -1).

    Fast-dLLM v2 pads with mask tokens so the last block looks like every other block at inference.
    """
    b, r = response_ids.shape
    extra = -r % block_size
    if extra == 0:
        return response_ids, roles
    ids = F.pad(response_ids, (0, extra), value=mask_token_id)  # [b, r + extra]
    return ids, F.pad(roles, (0, extra), value=PADDING)


class CFTNoise(NamedTuple):
    """Two complementary noisy views of a response batch and the positions each view supervises.

    noisy_a, noisy_b: [b, r] response ids with the noised positions replaced by the mask token.
    loss_a, loss_b: [b, r] bool, disjoint; their union is every non-padding position. ``loss_a`` is
    view a's masked positions plus every block's first position (its prediction comes from the clean
    copy, identical in both views, so it is counted once, in view a); ``loss_b`` is view b's masked
    positions other than a block's first.
    """

    noisy_a: torch.Tensor
    noisy_b: torch.Tensor
    loss_a: torch.Tensor
    loss_b: torch.Tensor


def cft_noise(
    response_ids: torch.Tensor,
    roles: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    eps: float = 1e-3,
    generator: torch.Generator | None = None,
    pattern: str = "complementary",
    commit_steps: torch.Tensor | None = None,
) -> CFTNoise:
    """Complementary block-wise masking for Conversion Fine-Tuning (Fast-dLLM v2;
    docs/architecture.md#training-stages).

    response_ids [b, r] with r a multiple of ``block_size`` (see :func:`pad_to_blocks`); roles [b, r].
    Padding = mask-token ids or role -1: never supervised. Per (row, block) a noise level t ~ U(0, 1);
    each maskable position is masked in view a with probability (1 - eps) t + eps, and view b masks
    exactly the maskable positions view a kept, so every token is supervised once across the pair.
    Position 0 of a block is masked like the others: the decoder's fused forward runs a block's first
    canvas before its first token is known (position 0 a mask), so training must show such canvases.
    Its own prediction always comes from the previous block's last *clean* position, exactly as the
    decoder commits it (shared with ``response_logits``), so it is supervised once, in view a.
    ``block_size == 1`` masks nothing and supervises every token in view a: the AR loss.

    ``pattern="suffix"``: the canvases the `prefix` decoder actually feeds. It commits a block left to
    right, so a canvas is always a committed prefix and a masked suffix; random masks spend the loss
    on patterns it never shows (a clean token right of a mask). Per (row, block) and view, the suffix
    from position L = floor(t k) is masked (t ~ U(0, 1), drawn apart for each view, so L = 0, the
    block's fused first forward, is one draw in k). The views are no longer complementary: a token is
    supervised in every view that masks it (and a block's first token once, in view a, as above).

    ``pattern="trajectory"``: the canvases a recorded decode really ran (trajectory distillation:
    dParallel, d3LLM). ``commit_steps`` [b, r] holds the forward of its block that committed each
    token (`DecodeOutput.commit_steps`: 1 = the block's first forward; padding any value). Per (row,
    block) and view, one of the block's forwards s is drawn uniformly (t ~ U(0, 1) as above) and the
    canvas it ran is rebuilt: the tokens committed before s visible, the rest masked. Every masked
    position is supervised with the token the decode finally wrote there, so positions it committed
    only in a later forward learn to be written in this one. Not complementary, as `suffix`.
    """
    b, r = _check_cft_args(response_ids, block_size, pattern, commit_steps)
    device = response_ids.device
    # Drawn where the generator lives, then moved: the same seed gives the same noise on any device.
    draw = generator.device if generator is not None else device
    t = torch.rand(b, r // block_size, generator=generator, device=draw).to(device)  # [b, blocks]
    p = ((1.0 - eps) * t + eps).repeat_interleave(block_size, dim=1)  # [b, r]
    u = torch.rand(b, r, generator=generator, device=draw).to(device)  # [b, r]
    real = (response_ids != mask_token_id) & (roles != PADDING)
    block_first = (torch.arange(r, device=device) % block_size == 0).unsqueeze(0)  # [1, r]
    maskable = real if block_size > 1 else torch.zeros_like(real)  # block size 1: the AR loss
    # after t and u: a second view's levels are the third draw, so a seed gives the same masks
    masked_a, masked_b = _view_masks(pattern, maskable, t, u < p, block_size, commit_steps, generator, draw)
    return _noised_views(response_ids, mask_token_id, masked_a, masked_b, real, block_first)


def _check_cft_args(
    response_ids: torch.Tensor, block_size: int, pattern: str, commit_steps: torch.Tensor | None
) -> tuple[int, int]:
    """(b, r) of `response_ids`; refuses an unknown pattern, misplaced commit steps, a ragged last block."""
    if pattern not in NOISE_PATTERNS:
        raise ValueError(f"CFT noise pattern must be one of {NOISE_PATTERNS}, got {pattern!r}")
    if (pattern == "trajectory") != (commit_steps is not None):
        raise ValueError("commit_steps are needed by, and only by, the trajectory pattern")
    b, r = response_ids.shape
    if r % block_size:
        raise ValueError(f"response length {r} is not a multiple of block size {block_size}")
    return b, r


def _view_masks(
    pattern: str,
    maskable: torch.Tensor,
    t: torch.Tensor,
    drawn_a: torch.Tensor,
    block_size: int,
    commit_steps: torch.Tensor | None,
    generator: torch.Generator | None,
    draw: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, r] bool masked positions of views a and b under `pattern` (`drawn_a`: u < p, complementary)."""
    if pattern == "complementary":
        masked_a = maskable & drawn_a
        return masked_a, maskable & ~masked_a
    b, r = maskable.shape  # one draw per view
    t_b = torch.rand(b, r // block_size, generator=generator, device=draw).to(maskable.device)
    if pattern == "suffix":
        in_block = torch.arange(r, device=maskable.device) % block_size  # [r]
        starts = [(tt * block_size).long().repeat_interleave(block_size, dim=1) for tt in (t, t_b)]
        masked_a, masked_b = (maskable & (in_block >= start) for start in starts)
        return masked_a, masked_b
    masked_a, masked_b = (maskable & _trajectory_masked(commit_steps, tt, block_size) for tt in (t, t_b))
    return masked_a, masked_b


def _noised_views(
    response_ids: torch.Tensor,
    mask_token_id: int,
    masked_a: torch.Tensor,
    masked_b: torch.Tensor,
    real: torch.Tensor,
    block_first: torch.Tensor,
) -> CFTNoise:
    """Both views with their masked positions set to the mask token, and what each supervises."""
    mask_id = torch.full_like(response_ids, mask_token_id)
    return CFTNoise(
        noisy_a=torch.where(masked_a, mask_id, response_ids),
        noisy_b=torch.where(masked_b, mask_id, response_ids),
        loss_a=(masked_a & ~block_first) | (real & block_first),
        loss_b=masked_b & ~block_first,
    )


def _trajectory_masked(commit_steps: torch.Tensor, t: torch.Tensor, block_size: int) -> torch.Tensor:
    """[b, r] bool: the positions still masked in the canvas of forward s = 1 + floor(t n) of each
    block, n its forwards (the largest commit step in it; padding carries -1). t [b, blocks] ~ U(0, 1)."""
    b, r = commit_steps.shape
    steps = commit_steps.view(b, r // block_size, block_size)
    forwards = steps.amax(-1).clamp_min(1)  # [b, blocks]
    drawn = 1 + (t * forwards).long().clamp_max(forwards - 1)  # [b, blocks], in 1..n
    return (steps >= drawn[..., None]).view(b, r)


def forward_kl(
    teacher_logits: torch.Tensor, student_logits: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token forward KL(teacher || student), averaged over masked tokens (OPD;
    docs/architecture.md#training-stages).

    teacher_logits, student_logits [b, r, v]; mask [b, r] bool (committed tokens of the rollout).
    Forward KL is mode-covering: the student is pushed to put mass wherever the teacher does. The
    teacher is treated as a constant (no gradient flows into it).
    """
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(f"teacher {tuple(teacher_logits.shape)} vs student {tuple(student_logits.shape)}")
    mask = mask.bool()
    log_t = F.log_softmax(teacher_logits.detach().float(), dim=-1)  # [b, r, v]
    log_s = F.log_softmax(student_logits.float(), dim=-1)  # [b, r, v]
    p_t = log_t.exp()
    # where(): a teacher probability of exactly 0 (a -inf logit) contributes 0, not 0 * -inf = nan.
    kl = torch.where(p_t > 0, p_t * (log_t - log_s), torch.zeros_like(p_t)).sum(dim=-1)  # [b, r]
    loss = (kl * mask).sum() / mask.sum().clamp_min(1)
    with torch.no_grad():
        agree = (log_t.argmax(dim=-1) == log_s.argmax(dim=-1)).float()
        metrics = {
            "kl": float(loss),
            "top1_agreement": _masked_mean(agree, mask),
            "teacher_entropy": _masked_mean(-torch.special.xlogy(p_t, p_t).sum(dim=-1), mask),
            "tokens": float(mask.sum()),
        }
    return loss, metrics
