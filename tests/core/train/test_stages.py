"""The stage losses on a synthetic re-ranking task: SFT, CFT, RL (AR and diffusion) and OPD."""

from __future__ import annotations

import copy

import pandas as pd
import pytest
import torch

from diffusion_gr2.core.decode.replay import replay_batch_logits
from diffusion_gr2.core.model.diffusion import response_logits
from diffusion_gr2.core.rank.rerank import RerankConfig, decode_config_for
from diffusion_gr2.core.text.examples import encode_requests, encode_sft
from diffusion_gr2.core.text.prompt import ItemLookup, PromptConfig
from diffusion_gr2.core.text.tokenizer import build_tokenizer
from diffusion_gr2.core.text.traces import (
    RuleBasedAnalyst,
    build_sft_rows,
    corpus_texts,
    examples_from_frame,
    rejection_sample,
)
from diffusion_gr2.core.train.grpo import GRPOConfig
from diffusion_gr2.core.train.loop import TrainConfig, move_to, train
from diffusion_gr2.core.train.stages import (
    RolloutConfig,
    SupervisedConfig,
    as_blocks,
    collate,
    example_batches,
    opd_batches,
    opd_loss,
    rl_batches,
    rl_loss,
    rollout_decode_config,
    rollout_logits,
    sample_rollouts,
    supervised_loss,
)
from tests.core.decode.test_replay import PROMPTS as DECODE_PROMPTS
from tests.core.decode.test_replay import _decode_with_mid_block_eos
from tests.core.model.tiny import ATOL, DEVICE, MASK, PAD, tiny_model, tiny_model_for
from tests.core.text.synthetic import make_candidates, make_items, make_sids, sid_tokens

PROMPT = PromptConfig(history_in_prompt=4, title_words=2, max_categories=1)


def make_task() -> dict:
    """Tokenizer, SFT examples and encoded requests of a small synthetic catalogue (seeded)."""
    items, sids = make_items(60, seed=0), make_sids(60, seed=0)
    candidates = make_candidates(items, n_users=24, seed=0, history_len=6, n_candidates=4)
    lookup = ItemLookup.from_frames(items, sids, PROMPT)
    rows, _ = rejection_sample(
        RuleBasedAnalyst(lookup, prompt_config=PROMPT), examples_from_frame(candidates), 8, 0
    )
    sft_rows = build_sft_rows(rows, lookup, PROMPT)
    tok = build_tokenizer(corpus_texts(sft_rows), sid_tokens(), vocab_size=400)
    return {
        "tokenizer": tok,
        "sft": encode_sft(sft_rows, tok),
        "requests": encode_requests(candidates, lookup, tok, PROMPT),
    }


@pytest.fixture(scope="module")
def task() -> dict:
    return make_task()


def policy_model(tok, block_size: int):
    """A tiny random policy: AR for block size 1, a converted block-diffusion model otherwise."""
    return tiny_model_for(tok, block_size if block_size > 1 else None)


def run(model, make_batch, loss_fn, tmp_path, steps: int = 2, lr: float = 1e-3):
    config = TrainConfig(output_dir=str(tmp_path), max_steps=steps, lr=lr, checkpoint_every=0, progress=False)
    return train(model, make_batch, loss_fn, config)


@pytest.mark.parametrize("block_size", [1, 4])
def test_supervised_loss_decreases(task: dict, tmp_path, block_size: int) -> None:
    tok = task["tokenizer"]
    model = policy_model(tok, block_size)
    config = SupervisedConfig(batch_size=4, block_size=block_size)
    make_batch = example_batches(task["sft"], tok.pad_token_id, config)
    loss_fn = supervised_loss(config, tok.mask_token_id)
    before = loss_fn(model, move_to(make_batch(0, model), model.device))[0].item()
    run(model, make_batch, loss_fn, tmp_path, steps=15, lr=3e-3)
    after = loss_fn(model, move_to(make_batch(0, model), model.device))[0].item()
    assert after < before - 0.3


def test_cft_with_block_size_one_is_sft(task: dict) -> None:
    tok = task["tokenizer"]
    model = tiny_model_for(tok)
    sft = SupervisedConfig(batch_size=4, block_size=1)
    batch = move_to(example_batches(task["sft"], tok.pad_token_id, sft)(0, model), model.device)
    loss_sft = supervised_loss(sft)(model, batch)[0]
    loss_b1 = supervised_loss(SupervisedConfig(batch_size=4, block_size=1), tok.mask_token_id)(model, batch)[
        0
    ]
    assert torch.allclose(loss_sft, loss_b1)


def _padded(rows: list[list], width: int, fill: float) -> torch.Tensor:
    return torch.tensor([[*row, *[fill] * (width - len(row))] for row in rows], device=DEVICE)


@pytest.mark.parametrize("tau", [0.9, 0.5])
@torch.no_grad()
def test_cft_forward_on_the_decoders_canvases_gives_the_logits_it_committed_from(tau: float) -> None:
    """CFT's training view (`as_blocks` + `response_logits`) of every canvas the decoder ran, the
    final block's trailing masks included, gives the distribution each token was committed from."""
    model, k = tiny_model(), 4
    outputs = _decode_with_mid_block_eos(model, k, tau, rule="prefix")  # the served commit rule
    lengths = [len(o.tokens) for o in outputs]
    assert any(n % k for n in lengths)  # an eos inside a block: that final block holds padding
    batch = move_to(as_blocks(collate(DECODE_PROMPTS, [o.tokens for o in outputs], PAD), k, MASK), DEVICE)
    width = batch.response_ids.shape[1]
    steps = _padded([o.commit_steps for o in outputs], width, -1).long()
    recorded = _padded([o.token_logprobs for o in outputs], width, 0.0)
    replayed = replay_batch_logits(model, DECODE_PROMPTS, outputs, k, MASK).log_softmax(-1)  # [b, r, v]
    replayed = torch.nn.functional.pad(replayed, (0, 0, 0, width - replayed.shape[1]))  # [b, width, v]
    checked = torch.zeros_like(steps, dtype=torch.bool)
    for step in range(1, int(steps.max()) + 1):
        canvas = torch.where((steps >= 0) & (steps < step), batch.response_ids, MASK)
        logp = response_logits(
            model, batch.prompt_ids, batch.response_ids, k, canvas, batch.prompt_mask, batch.response_mask
        ).log_softmax(-1)
        here = (steps == step) | ((steps == 0) & (step == 1))  # a block's first token: any canvas
        taken = logp.gather(-1, batch.response_ids[..., None]).squeeze(-1)
        torch.testing.assert_close(taken[here], recorded[here], atol=2 * ATOL, rtol=0)
        torch.testing.assert_close(logp[here], replayed[here], atol=2 * ATOL, rtol=0)
        checked |= here
    final_block = torch.stack([torch.arange(width, device=DEVICE) // k == (n - 1) // k for n in lengths])
    assert bool(checked[steps >= 0].all()) and bool((checked & final_block).sum() >= len(lengths))


def assert_replay_matches_the_decoder(model, rollouts, pad_id: int, temperature: float) -> None:
    """The rollouts' log-probs rebuilt by `rollout_logits` equal those the decoder sampled with."""
    logits = rollout_logits(model, rollouts, pad_id) / temperature
    for row, out in enumerate(rollouts.outputs):
        replayed = torch.log_softmax(logits[row, : len(out.tokens)].float(), -1)
        taken = replayed.gather(-1, torch.tensor(out.tokens, device=replayed.device)[:, None]).squeeze(-1)
        assert torch.allclose(taken.cpu(), torch.tensor(out.token_logprobs), atol=1e-4)


@pytest.mark.parametrize(("block_size", "rule"), [(1, "prefix"), (4, "prefix"), (4, "confident")])
def test_rollouts_are_scored_and_replayed(task: dict, block_size: int, rule: str) -> None:
    tok = task["tokenizer"]
    model = policy_model(tok, block_size)
    config = RolloutConfig(group_size=2, max_new_tokens=24, threshold=0.5, commit_rule=rule)
    decoding = rollout_decode_config(model, tok, config, seed=0)
    # rollouts decode as served: the commit rule, and for diffusion the SID threshold and repeat gate
    served = decode_config_for(model, tok, config.threshold if block_size > 1 else None, RerankConfig())
    assert decoding.commit_rule == rule
    assert (decoding.sid_threshold, decoding.sid_token_ids, decoding.repeat_gate) == (
        served.sid_threshold,
        served.sid_token_ids,
        served.repeat_gate,
    )
    assert decoding.repeat_gate == (decoding.sid_threshold is not None) == (block_size > 1)
    rollouts = sample_rollouts(model, tok, task["requests"].head(2), config, seed=0)
    assert rollouts.rewards.shape == (2, 2)
    # An untrained model writes no valid JSON ranking: every reward is the invalid-output -1.
    assert torch.all(rollouts.rewards == -1) and not rollouts.valid.any()
    assert_replay_matches_the_decoder(model, rollouts, tok.pad_token_id, config.temperature)


@pytest.mark.parametrize("block_size", [1, 4])
def test_constrained_rollouts_are_valid_and_replay_the_constrained_policy(
    task: dict, block_size: int
) -> None:
    tok = task["tokenizer"]
    model = policy_model(tok, block_size)
    config = RolloutConfig(group_size=2, max_new_tokens=64, threshold=0.5, constrained=True)
    rollouts = sample_rollouts(model, tok, task["requests"].head(2), config, seed=0)
    assert rollouts.valid.all() and (rollouts.rewards > -1).all()  # the reward is about ranking only
    assert all(o.forced > 0 for o in rollouts.outputs)  # random weights: the grammar wrote them
    # The policy scored is the one sampled from: softmax over the tokens the grammar allowed.
    assert_replay_matches_the_decoder(model, rollouts, tok.pad_token_id, config.temperature)
    with pytest.raises(ValueError, match="unconstrained"):
        opd_batches(model, tok, task["requests"], config)


def test_grpo_step_runs_and_drops_zero_variance_groups(task: dict, tmp_path) -> None:
    tok = task["tokenizer"]
    model = tiny_model_for(tok, 4)
    config = RolloutConfig(prompts_per_step=2, group_size=2, max_new_tokens=16)
    make_batch = rl_batches(tok, task["requests"], config, GRPOConfig(mini_batches=1))
    batch = move_to(make_batch(0, model), model.device)
    _, metrics = rl_loss(tok.pad_token_id, GRPOConfig(mini_batches=1))(model, batch)
    assert metrics["kept_groups"] == 0.0 and batch.rows == []  # all invalid (-1): no variance, no signal
    before = copy.deepcopy(model.state_dict())
    run(model, make_batch, rl_loss(tok.pad_token_id, GRPOConfig(mini_batches=1)), tmp_path, steps=1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("block_size", [1, 4])
def test_rl_reuses_each_rollout_batch_and_the_clip_acts(
    task: dict, tmp_path, block_size: int, recompute: bool
) -> None:
    """Production RL on a tiny policy (AR, and diffusion by replay): the first update on a rollout
    batch is on-policy (ratio 1, the decoder's log-probs equal the training forward's), and the later
    updates on the same rollouts see the policy move and clip."""
    tok = task["tokenizer"]
    model = policy_model(tok, block_size)
    # under the grammar every rollout is a valid ranking, so rewards differ within a group
    rollout = RolloutConfig(
        prompts_per_step=2, group_size=4, max_new_tokens=64, threshold=0.5, constrained=True
    )
    grpo = GRPOConfig(0.2, 0.2, ppo_epochs=3, mini_batches=2, recompute_old_logprobs=recompute)
    history = run(
        model,
        rl_batches(tok, task["requests"], rollout, grpo),
        rl_loss(tok.pad_token_id, grpo),
        tmp_path,
        6,
        3e-2,
    ).history
    first, later = history[0], history[1:]
    assert first["kept_groups"] > 0 and (
        first["behaviour_gap"] < 1e-5 if recompute else "behaviour_gap" not in first
    )
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and first["clip_fraction"] == 0.0
    assert [h["ppo_epoch"] for h in history] == [0, 0, 1, 1, 2, 2]
    assert all(h["kl_old"] > 0 for h in later) and max(h["clip_fraction"] for h in later) > 0
    assert all(h["entropy"] > 0 for h in history)


def test_opd_loss_zero_for_identical_ar_models_and_positive_otherwise(task: dict) -> None:
    tok = task["tokenizer"]
    teacher = tiny_model_for(tok)
    config = RolloutConfig(prompts_per_step=2, group_size=2, max_new_tokens=16)
    same = opd_batches(teacher, tok, task["requests"], config)
    loss_same, _ = opd_loss(tok.pad_token_id)(
        copy.deepcopy(teacher), move_to(same(0, teacher), teacher.device)
    )
    assert loss_same.item() == pytest.approx(0.0, abs=1e-5)
    student = tiny_model_for(tok, 4)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.05 * torch.randn_like(p))
    loss_diff, _ = opd_loss(tok.pad_token_id)(
        student, move_to(opd_batches(teacher, tok, task["requests"], config)(0, student), student.device)
    )
    assert loss_diff.item() > 1e-3


def test_encoded_frames(task: dict) -> None:
    assert isinstance(task["requests"], pd.DataFrame)
    assert all(len(s) == 4 for s in task["requests"]["candidate_sids"])
    assert (task["sft"]["response_ids"].map(len) == task["sft"]["response_roles"].map(len)).all()
