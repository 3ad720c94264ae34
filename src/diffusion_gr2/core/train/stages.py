"""The training stages as (make_batch, loss_fn) pairs for the one loop (docs/architecture.md#training-stages).

SFT and CFT read fixed token examples; RL (AR or diffusion) and OPD read rollouts that the current
policy decodes with the one decoder. A policy is told apart only by its block size: 1 is the AR
model (log-probs from one causal forward), k > 1 a block-diffusion model (log-probs by replaying the
canvas each token was committed from — TraceRL). Every ``make_batch`` is a pure function of the
micro-batch index, the seed and the current weights, so a resumed run repeats itself exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from diffusion_gr2.core.decode.decoder import DecodeConfig, DecodeOutput, decode
from diffusion_gr2.core.decode.grammar import AnswerGrammar, allowed_masks, answer_grammars
from diffusion_gr2.core.decode.replay import replay_batch_logits
from diffusion_gr2.core.model.diffusion import response_logits
from diffusion_gr2.core.rank.rerank import RerankConfig, decode_config_for
from diffusion_gr2.core.rank.rewards import INVALID_REWARD, ranking_reward
from diffusion_gr2.core.text.parser import parse_answer
from diffusion_gr2.core.text.tokenizer import IM_END, decode_response
from diffusion_gr2.core.train.grpo import (
    GRPOConfig,
    GRPORound,
    LogitsFn,
    grpo_loss,
    make_round,
    reuse_batches,
)
from diffusion_gr2.core.train.loop import move_to
from diffusion_gr2.core.train.losses import (
    certainty_penalty,
    cft_noise,
    forward_kl,
    pad_to_blocks,
    weighted_token_ce,
)

PADDING_ROLE = -1


# ---- batches of token sequences -------------------------------------------------------------------
@dataclass(frozen=True)
class TokenBatch:
    """Prompts left-padded [b, p] and responses right-padded [b, r], with validity masks and roles."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor  # [b, r] keys: real tokens (block form: whole blocks, `as_blocks`)
    roles: torch.Tensor  # [b, r]; PADDING_ROLE on padding
    index: int = 0  # micro-batch index: seeds the CFT noise of this batch
    # [b, r] the forward of its block that committed each token of a recorded decode (-1 on padding):
    # the canvases of trajectory distillation (`losses.cft_noise`, pattern "trajectory"); else None
    commit_steps: torch.Tensor | None = None


def collate(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_id: int,
    roles: Sequence[Sequence[int]] | None = None,
    index: int = 0,
    commit_steps: Sequence[Sequence[int]] | None = None,
) -> TokenBatch:
    b, p, r = len(prompts), max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.full((b, p), pad_id, dtype=torch.long)
    response_ids = torch.full((b, r), pad_id, dtype=torch.long)
    role_ids = torch.full((b, r), PADDING_ROLE, dtype=torch.long)
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        prompt_ids[i, p - len(prompt) :] = torch.tensor(prompt)  # left padding: the response follows
        response_ids[i, : len(response)] = torch.tensor(response)
        role_ids[i, : len(response)] = torch.tensor(roles[i]) if roles is not None else 1
    prompt_mask = torch.arange(p)[None, :] >= torch.tensor([p - len(x) for x in prompts])[:, None]
    response_mask = role_ids != PADDING_ROLE
    steps = None
    if commit_steps is not None:
        steps = torch.full((b, r), -1, dtype=torch.long)
        for i, row in enumerate(commit_steps):
            steps[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return TokenBatch(prompt_ids, prompt_mask, response_ids, response_mask, role_ids, index, steps)


def epoch_sampler(n: int, batch_size: int, seed: int) -> Callable[[int], np.ndarray]:
    """Row indices of micro-batch ``index``: a fresh seeded permutation of the n rows every epoch."""
    per_epoch = max(1, n // batch_size)

    def rows(index: int) -> np.ndarray:
        epoch, slot = divmod(index, per_epoch)
        order = np.random.default_rng([seed, epoch]).permutation(n)
        return order[slot * batch_size : (slot + 1) * batch_size]

    return rows


# ---- SFT and CFT: fixed teacher traces ----------------------------------------------------------
@dataclass(frozen=True)
class SupervisedConfig:
    """SFT (block_size 1) and CFT (block_size k > 1) on the assistant message."""

    batch_size: int = 8  # examples per micro-batch
    lambda_r: float = 0.5  # weight of reasoning tokens (GR2: answer tokens weigh more)
    lambda_o: float = 1.0  # weight of answer tokens
    block_size: int = 1  # 1 = AR SFT; k > 1 = conversion fine-tuning with block size k
    eps: float = 1e-3  # CFT: minimum masking probability of a position
    seed: int = 0
    # CFT canvases (`losses.cft_noise`): "complementary" random masks (Fast-dLLM v2), "suffix"
    # (a committed prefix and a masked suffix per block: what the `prefix` decoder feeds) or
    # "trajectory" (the canvases a recorded decode ran: trajectory distillation, `core/train/trajectory.py`)
    noise: str = "complementary"
    # Weight of the certainty term (`losses.certainty_penalty`: entropy of the masked positions already
    # predicted right) added to the CE; 0 = plain CE (SFT, CFT)
    certainty: float = 0.0


def example_batches(examples: pd.DataFrame, pad_id: int, config: SupervisedConfig) -> Callable:
    """``make_batch(index, model)`` over an examples frame (prompt_ids, response_ids, response_roles):
    SFT examples, or recorded trajectories, whose ``commit_steps`` column the batch then carries."""
    rows_of = epoch_sampler(len(examples), config.batch_size, config.seed)
    prompts, responses, roles = (list(examples[c]) for c in ("prompt_ids", "response_ids", "response_roles"))
    steps = list(examples["commit_steps"]) if "commit_steps" in examples else None

    def make_batch(index: int, model: torch.nn.Module) -> TokenBatch:
        rows = rows_of(index)
        return collate(
            [prompts[i] for i in rows],
            [responses[i] for i in rows],
            pad_id,
            [roles[i] for i in rows],
            index,
            None if steps is None else [steps[i] for i in rows],
        )

    return make_batch


def as_blocks(batch: TokenBatch, block_size: int, mask_token_id: int) -> TokenBatch:
    """`batch` with its responses padded to whole blocks of `block_size`, as the decoder writes them.

    Padding becomes mask tokens with role `PADDING_ROLE` (never a loss). `response_mask` (the keys)
    covers every position of a row's blocks, its final block's trailing masks included: the decoder
    runs a block as one canvas whose every position is a key (docs/architecture.md#decoding), and the answer
    and `<|im_end|>` are in that block. Blocks after a row's final one exist only because the batch is
    padded; nothing attends to them and they are not keys.
    """
    ids, roles = pad_to_blocks(batch.response_ids, batch.roles, block_size, mask_token_id)
    ids = torch.where(roles == PADDING_ROLE, mask_token_id, ids)
    length = (roles != PADDING_ROLE).sum(1, keepdim=True)  # [b, 1]: responses are right-padded
    in_blocks = -(-length // block_size) * block_size  # [b, 1]: the end of each row's final block
    keys = torch.arange(ids.shape[1], device=ids.device)[None, :] < in_blocks  # [b, r]
    steps = batch.commit_steps
    if steps is not None:
        steps = torch.nn.functional.pad(steps, (0, ids.shape[1] - steps.shape[1]), value=-1)
    return replace(batch, response_ids=ids, roles=roles, response_mask=keys, commit_steps=steps)


def supervised_loss(config: SupervisedConfig, mask_token_id: int | None = None) -> Callable:
    """SFT loss (block size 1) or CFT loss: masked-diffusion CE with two noisy views
    (docs/architecture.md#training-stages).

    Trajectory distillation is the same loss on recorded canvases (`config.noise="trajectory"`, the
    batch's `commit_steps`) plus the certainty term (`config.certainty`)."""
    k = config.block_size

    def loss_fn(model: PreTrainedModel, batch: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
        if k == 1:
            logits = response_logits(
                model, batch.prompt_ids, batch.response_ids, 1, None, batch.prompt_mask, batch.response_mask
            )
            return weighted_token_ce(
                logits, batch.response_ids, batch.roles, batch.response_mask, config.lambda_r, config.lambda_o
            )
        batch = as_blocks(batch, k, mask_token_id)
        ids, roles = batch.response_ids, batch.roles
        gen = torch.Generator().manual_seed(config.seed * 1_000_003 + batch.index)
        noise = cft_noise(ids, roles, k, mask_token_id, config.eps, gen, config.noise, batch.commit_steps)
        # Both complementary views in one forward, as two noisy copies sharing the prompt and the
        # clean copy: every response token is supervised once.
        logits = response_logits(
            model,
            batch.prompt_ids,
            ids,
            k,
            torch.stack([noise.noisy_a, noise.noisy_b], 1),
            batch.prompt_mask,
            batch.response_mask,
        ).flatten(0, 1)  # [2b, r, v]: view a and view b of each row, in turn
        targets, supervised = (
            ids.repeat_interleave(2, 0),
            torch.stack([noise.loss_a, noise.loss_b], 1).flatten(0, 1),
        )
        loss, metrics = weighted_token_ce(
            logits, targets, roles.repeat_interleave(2, 0), supervised, config.lambda_r, config.lambda_o
        )
        if config.certainty > 0:
            penalty, more = certainty_penalty(logits, targets, supervised)
            loss, metrics = loss + config.certainty * penalty, {**metrics, **more}
        return loss, metrics

    return loss_fn


# ---- rollouts: RL and OPD ----------------------------------------------------------------------
@dataclass(frozen=True)
class RolloutConfig:
    """How the policy samples its own answers."""

    prompts_per_step: int = 4  # distinct requests per micro-batch
    group_size: int = 8  # rollouts per request (G; OPD uses 4)
    temperature: float = 1.0  # sampling temperature of rollouts
    threshold: float = 0.9  # tau for block-diffusion rollouts
    # block diffusion: the tau a SID code must clear to join a forward's parallel commits, as served
    # (`RerankConfig.sid_threshold`; None = `threshold` everywhere)
    sid_threshold: float | None = RerankConfig.sid_threshold
    # block diffusion: the repeat gate, as served (`RerankConfig.repeat_gate`)
    repeat_gate: bool = RerankConfig.repeat_gate
    # as at inference: rollouts decode the way the model is served
    commit_rule: str = DecodeConfig.commit_rule
    max_new_tokens: int = 192
    alpha: float = 0.2  # conditional format reward (GR2)
    invalid_reward: float = INVALID_REWARD  # an unparseable answer's reward, below every valid one
    # Sample under each request's answer grammar, as served: every rollout is a valid ranking, so the
    # reward is about ranking only, and the policy scored is the constrained one (renormalised).
    constrained: bool = False
    seed: int = 0


@dataclass(frozen=True)
class Rollouts:
    """Rollouts laid out request-major: ``outputs[i * g + j]`` is rollout j of request i."""

    prompts: list[list[int]]  # one per rollout
    outputs: list[DecodeOutput]
    rewards: torch.Tensor  # [n_requests, g]
    valid: torch.Tensor  # [n_requests, g] bool
    block_size: int
    mask_token_id: int | None
    grammars: list[AnswerGrammar] | None = None  # one per rollout when sampled under the grammar
    max_new_tokens: int = 0  # the budget the grammars saw

    def token_batch(self, pad_id: int) -> TokenBatch:
        return collate(self.prompts, [o.tokens for o in self.outputs], pad_id)


def policy_block_size(model: PreTrainedModel) -> int:
    return int(getattr(model.config, "block_size", 1) or 1)


def rollout_decode_config(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: RolloutConfig, seed: int
) -> DecodeConfig:
    """Rollouts decode as inference does (the one builder), sampled, 64 rows at a time."""
    block_size = policy_block_size(model)
    decoding = RerankConfig(
        max_new_tokens=config.max_new_tokens,
        batch_size=64,
        commit_rule=config.commit_rule,
        sid_threshold=config.sid_threshold,
        repeat_gate=config.repeat_gate,
    )
    tau = config.threshold if block_size > 1 else None
    return decode_config_for(
        model, tokenizer, tau, decoding, do_sample=True, temperature=config.temperature, seed=seed
    )


def score_rollout(
    tokenizer: PreTrainedTokenizerBase,
    output: DecodeOutput,
    request: pd.Series,
    alpha: float,
    invalid_reward: float = INVALID_REWARD,
) -> tuple[float, bool]:
    """Reward of one rollout (docs/evaluation.md#metrics-and-the-reward): rank promotion + conditional format
    bonus, −1 if invalid."""
    sids = list(request["candidate_sids"])
    parsed = parse_answer(decode_response(tokenizer, output.tokens), sids)
    candidates = [int(i) for i in request["candidates"]]
    ranking = [candidates[sids.index(s)] for s in parsed.ranking] if parsed.valid and parsed.ranking else None
    reward = ranking_reward(candidates, ranking, int(request["target"]), parsed.valid, alpha, invalid_reward)
    return reward, parsed.valid


def sample_rollouts(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    requests: pd.DataFrame,
    config: RolloutConfig,
    seed: int,
) -> Rollouts:
    """G sampled answers per request from the policy's own decoder, with their rewards."""
    g = config.group_size
    prompts = [list(p) for p in requests["prompt_ids"] for _ in range(g)]
    grammars = None
    if config.constrained:
        candidates = [[str(s) for s in c] for c in requests["candidate_sids"] for _ in range(g)]
        grammars = answer_grammars(tokenizer, candidates, IM_END)
    was_training = model.training
    model.eval()
    outputs = decode(model, prompts, rollout_decode_config(model, tokenizer, config, seed), grammars)
    model.train(was_training)
    scored = [
        score_rollout(tokenizer, o, requests.iloc[i // g], config.alpha, config.invalid_reward)
        for i, o in enumerate(outputs)
    ]
    rewards = torch.tensor([s[0] for s in scored], dtype=torch.float32).view(len(requests), g)
    valid = torch.tensor([s[1] for s in scored]).view(len(requests), g)
    return Rollouts(
        prompts,
        outputs,
        rewards,
        valid,
        policy_block_size(model),
        tokenizer.mask_token_id,
        grammars,
        config.max_new_tokens,
    )


def rollout_logits(
    model: PreTrainedModel, rollouts: Rollouts, pad_id: int, rows: Sequence[int] | None = None
) -> torch.Tensor:
    """[b, r, v] logits each rollout token was sampled from, under the current weights.

    `rows` limits the work to those rollouts (b = len(rows), r = their longest response).
    Block size 1: one causal forward over the padded batch. k > 1: batched replay of the commit canvases.
    Rollouts sampled under a grammar get the tokens it did not allow masked out (-inf), so softmax
    gives the constrained policy they were sampled from.
    """
    rows = range(len(rollouts.outputs)) if rows is None else rows
    prompts, outputs = [rollouts.prompts[i] for i in rows], [rollouts.outputs[i] for i in rows]
    if rollouts.block_size == 1:
        batch = move_to(collate(prompts, [o.tokens for o in outputs], pad_id), model.device)
        logits = response_logits(
            model, batch.prompt_ids, batch.response_ids, 1, None, batch.prompt_mask, batch.response_mask
        )
    else:
        logits = replay_batch_logits(model, prompts, outputs, rollouts.block_size, rollouts.mask_token_id)
    if rollouts.grammars is None:
        return logits
    allowed = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
    for row, i in enumerate(rows):
        out = rollouts.outputs[i]
        masks = allowed_masks(rollouts.grammars[i], out.tokens, rollouts.max_new_tokens, logits.shape[-1])
        allowed[row, : len(out.tokens)] = masks.to(logits.device)
    return logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)


def request_sampler(requests: pd.DataFrame, per_step: int, seed: int) -> Callable[[int], pd.DataFrame]:
    rows_of = epoch_sampler(len(requests), per_step, seed)
    return lambda index: requests.iloc[rows_of(index)]


def share_sampler(
    requests: pd.DataFrame, per_step: int, shares: int, seed: int
) -> Callable[[int, int], pd.DataFrame]:
    """``take(step, share)``: share ``share`` of step ``step``'s ``per_step`` requests (whole requests,
    so a group of rollouts is never split), the same requests however the shares are laid out."""
    if per_step % shares:
        raise ValueError(
            f"rollout.prompts_per_step ({per_step}) must be a multiple of grad_accum x processes ({shares}): "
            "each micro-batch slot of a step samples its own whole requests"
        )
    take, size = request_sampler(requests, per_step, seed), per_step // shares
    return lambda step, share: take(step).iloc[share * size : (share + 1) * size]


def sum_over_processes(value: float) -> float:
    """``value`` summed over the processes of a launch (itself in one process): a collective."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return float(value)
    from accelerate.state import PartialState  # the device the process group's backend reduces on

    total = torch.tensor([float(value)], dtype=torch.float64, device=PartialState().device)
    torch.distributed.all_reduce(total)
    return float(total.item())


def rl_batches(
    tokenizer: PreTrainedTokenizerBase,
    requests: pd.DataFrame,
    config: RolloutConfig,
    grpo: GRPOConfig,
    grad_accum: int = 1,
    num_processes: int = 1,
) -> Callable:
    """``make_batch``: G rollouts per request, rewards, group advantages, old log-probs (DAPO), each
    rollout batch reused for ``grpo.updates`` optimiser steps (``grpo.reuse_batches``).

    ``rollout.prompts_per_step`` is the whole step's rollout batch, shared out over the micro-batch
    slots of the step (``grad_accum x processes``): each process samples its own shares, and the
    global batch stays the same whatever the number of processes.
    """
    shares = grad_accum * num_processes
    take = share_sampler(requests, config.prompts_per_step, shares, config.seed)
    logits_fn = _rollout_logits_fn(tokenizer.pad_token_id)

    def sample_share(round_no: int, share: int, shares: int, model: PreTrainedModel) -> GRPORound:
        seed = config.seed * 1_000_003 + round_no * shares + share
        rollouts = sample_rollouts(model, tokenizer, take(round_no, share), config, seed=seed)
        batch = rollouts.token_batch(tokenizer.pad_token_id)
        recorded = torch.nn.utils.rnn.pad_sequence(
            [torch.tensor(o.token_logprobs, dtype=torch.float32) for o in rollouts.outputs], batch_first=True
        )
        return make_round(
            model,
            logits_fn,
            rollouts,
            batch.response_ids,
            batch.response_mask,
            rollouts.rewards,
            config.temperature,
            recorded,
            rollout_metrics(rollouts),
            grpo.recompute_old_logprobs,
        )

    return reuse_batches(sample_share, grpo, grad_accum, num_processes, config.seed, sum_over_processes)


def _rollout_logits_fn(pad_id: int) -> LogitsFn:
    """The policy's own view of its rollouts, for the GRPO core: `rollout_logits` of some rows."""

    def logits_fn(model: torch.nn.Module, rollouts: Rollouts, rows: Sequence[int]) -> torch.Tensor:
        return rollout_logits(model, rollouts, pad_id, rows)

    return logits_fn


def rl_loss(pad_id: int, grpo: GRPOConfig) -> Callable:
    """The GRPO/DAPO loss (``grpo.grpo_loss``) with log-probs from the policy's own view (replay for k > 1)."""
    return grpo_loss(_rollout_logits_fn(pad_id), grpo)


def rollout_metrics(rollouts: Rollouts) -> dict[str, float]:
    valid = rollouts.valid.flatten().tolist()
    nfe = sum(o.nfe for o in rollouts.outputs)
    tokens = sum(len(o.tokens) for o in rollouts.outputs)
    return {
        "reward_mean": float(rollouts.rewards.mean()),
        "reward_std": float(rollouts.rewards.std(dim=1).mean()),
        "valid_rate": float(rollouts.valid.float().mean()),
        # sampled rollouts valid with no grammar correction (= valid_rate for unconstrained rollouts,
        # the default); not `unforced_rate`, which is greedy decoding without the grammar (inference)
        "uncorrected_rate": float(
            np.mean([v and o.forced == 0 for v, o in zip(valid, rollouts.outputs, strict=True)])
        ),
        "tokens_per_forward": tokens / max(nfe, 1),
        "output_tokens": tokens / len(rollouts.outputs),
    }


@dataclass(frozen=True)
class OPDBatch:
    rollouts: Rollouts
    teacher_logits: torch.Tensor  # [b, r, v], computed once per rollout and cached here
    mask: torch.Tensor  # [b, r]


def opd_batches(
    teacher: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    requests: pd.DataFrame,
    config: RolloutConfig,
    grad_accum: int = 1,
    num_processes: int = 1,
) -> Callable:
    """``make_batch``: student rollouts scored once by the frozen AR teacher (one causal forward).

    As in RL, ``rollout.prompts_per_step`` is the whole step's batch, shared out over the step's
    ``grad_accum x processes`` micro-batch slots.
    """
    if config.constrained:  # a masked student puts zero mass where the teacher may not: KL is infinite
        raise ValueError("OPD rollouts must be unconstrained (rollout.constrained: false)")
    shares = grad_accum * num_processes
    take = share_sampler(requests, config.prompts_per_step, shares, config.seed)
    pad_id = tokenizer.pad_token_id

    def make_batch(index: int, student: PreTrainedModel) -> OPDBatch:
        step, share = divmod(index, shares)
        rollouts = sample_rollouts(
            student, tokenizer, take(step, share), config, seed=config.seed * 1_000_003 + index
        )
        teacher.to(student.device)  # in place; a no-op once it is there
        batch = move_to(rollouts.token_batch(pad_id), student.device)
        with torch.no_grad():
            teacher_logits = response_logits(
                teacher, batch.prompt_ids, batch.response_ids, 1, None, batch.prompt_mask, batch.response_mask
            )
        return OPDBatch(rollouts, teacher_logits, batch.response_mask)

    return make_batch


def opd_loss(pad_id: int) -> Callable:
    """Forward KL(teacher ‖ student) per committed token, the student's view rebuilt by replay."""

    def loss_fn(student: PreTrainedModel, batch: OPDBatch) -> tuple[torch.Tensor, dict[str, float]]:
        student_logits = rollout_logits(student, batch.rollouts, pad_id)
        loss, metrics = forward_kl(batch.teacher_logits, student_logits, batch.mask)
        return loss, {**metrics, **rollout_metrics(batch.rollouts)}

    return loss_fn
