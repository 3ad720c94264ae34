"""Trajectory distillation: recorded decodes, the canvases rebuilt from them, and the loss on them."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from diffusion_gr2.core.evaluate.metrics import cited_sids
from diffusion_gr2.core.model.diffusion import response_logits
from diffusion_gr2.core.rank.rerank import RerankConfig
from diffusion_gr2.core.text.parser import parse_answer
from diffusion_gr2.core.train.loop import TrainConfig, move_to, train
from diffusion_gr2.core.train.losses import REASONING, cft_noise
from diffusion_gr2.core.train.stages import (
    SupervisedConfig,
    as_blocks,
    collate,
    example_batches,
    supervised_loss,
)
from diffusion_gr2.core.train.trajectory import (
    EXAMPLE_COLUMNS,
    TRAJECTORY_COLUMNS,
    TrajectoryConfig,
    grounded,
    kept_trajectories,
    rank_reason,
    record_trajectories,
    self_training_examples,
    token_roles,
)
from tests.core.decode.test_replay import PROMPTS as DECODE_PROMPTS
from tests.core.decode.test_replay import _decode_with_mid_block_eos
from tests.core.model.tiny import ATOL, DEVICE, MASK, PAD, tiny_model, tiny_model_for
from tests.core.train.test_stages import task  # noqa: F401 (fixture)

torch.set_num_threads(1)
K = 4


def _recorded_batch(tau: float = 0.5):
    """A tiny model's decodes under the `prefix` rule, as a distillation batch in block form."""
    model = tiny_model()
    outputs = _decode_with_mid_block_eos(model, K, tau, rule="prefix")
    batch = collate(
        DECODE_PROMPTS,
        [o.tokens for o in outputs],
        PAD,
        roles=[[i % 2 for i in range(len(o.tokens))] for o in outputs],
        commit_steps=[o.commit_steps for o in outputs],
    )
    return model, outputs, move_to(as_blocks(batch, K, MASK), DEVICE)


def test_trajectory_noise_rebuilds_canvases_the_decoder_ran() -> None:
    """Each view's canvas of a block is one the decode really fed (tokens committed before forward s
    visible, the rest masked), every forward of every block is drawn, and padding is never a loss."""
    _, outputs, batch = _recorded_batch()
    ids, roles, steps = batch.response_ids, batch.roles, batch.commit_steps
    b, r = ids.shape
    seen: set[tuple[int, int, int]] = set()
    for seed in range(40):
        noise = cft_noise(
            ids,
            roles,
            K,
            MASK,
            generator=torch.Generator().manual_seed(seed),
            pattern="trajectory",
            commit_steps=steps,
        )
        for noisy, loss in ((noise.noisy_a, noise.loss_a), (noise.noisy_b, noise.loss_b)):
            for i in range(b):
                n = len(outputs[i].tokens)
                for start in range(0, n, K):
                    block, block_steps = noisy[i, start : start + K], steps[i, start : start + K]
                    real = block_steps >= 0
                    forwards = int(block_steps.max())
                    canvases = [
                        torch.where(real & (block_steps < s), ids[i, start : start + K], MASK)
                        for s in range(1, forwards + 1)
                    ]
                    match = [s for s, c in enumerate(canvases, 1) if torch.equal(c[real], block[real])]
                    assert match, (i, start, block, block_steps)
                    seen.add((i, start, match[0]))
                assert not loss[i, n:].any()  # padding and trailing masks: never supervised
    every = {
        (i, s, f)
        for i, o in enumerate(outputs)
        for s in range(0, len(o.tokens), K)
        for f in range(1, max(o.commit_steps[s : s + K]) + 1)
    }
    assert seen == every
    with pytest.raises(ValueError, match="commit_steps"):
        cft_noise(ids, roles, K, MASK, pattern="trajectory")


@torch.no_grad()
def test_a_recorded_trajectory_replays_to_the_decoders_logprobs() -> None:
    """On a canvas rebuilt by the trajectory pattern, the training forward gives each token committed
    at that forward the log-prob the decoder recorded: distillation trains on what decoding saw."""
    model, outputs, batch = _recorded_batch()
    width = batch.response_ids.shape[1]
    recorded = torch.tensor(
        [[*o.token_logprobs, *[0.0] * (width - len(o.tokens))] for o in outputs], device=DEVICE
    )
    checked = torch.zeros_like(batch.commit_steps, dtype=torch.bool)
    for seed in range(12):
        noise = cft_noise(
            batch.response_ids,
            batch.roles,
            K,
            MASK,
            generator=torch.Generator().manual_seed(seed),
            pattern="trajectory",
            commit_steps=batch.commit_steps,
        )
        logp = response_logits(
            model,
            batch.prompt_ids,
            batch.response_ids,
            K,
            torch.stack([noise.noisy_a, noise.noisy_b], 1),
            batch.prompt_mask,
            batch.response_mask,
        ).log_softmax(-1)  # [b, 2, r, v]
        for view, noisy in enumerate((noise.noisy_a, noise.noisy_b)):
            masked = (noisy == MASK) & (batch.commit_steps >= 1)
            # the canvas of forward s: s is the earliest commit step among its masked positions, and
            # every position committed at s was committed from this very canvas
            steps = torch.where(masked, batch.commit_steps, 10**6).view(len(outputs), -1, K)
            s_of_block = steps.amin(-1, keepdim=True).expand_as(steps).reshape_as(masked)
            due = masked & (batch.commit_steps == s_of_block)
            due &= torch.arange(width, device=DEVICE) % K != 0  # a block's first token: the clean copy
            taken = logp[:, view].gather(-1, batch.response_ids[..., None]).squeeze(-1)
            torch.testing.assert_close(taken[due], recorded[due], atol=2 * ATOL, rtol=0)
            checked |= due
    not_first = (batch.commit_steps >= 1) & (torch.arange(width, device=DEVICE) % K != 0)
    assert bool(checked[not_first].all())  # every token, at the forward that committed it


def _loop_reference(model, batch, noise, config: SupervisedConfig) -> torch.Tensor:
    """The distillation loss one row, one view and one position at a time."""
    num = den = cert = n_correct = 0.0
    for i in range(batch.response_ids.shape[0]):
        for noisy, supervised in ((noise.noisy_a, noise.loss_a), (noise.noisy_b, noise.loss_b)):
            logits = response_logits(
                model,
                batch.prompt_ids[i : i + 1],
                batch.response_ids[i : i + 1],
                K,
                noisy[i : i + 1],
                batch.prompt_mask[i : i + 1],
                batch.response_mask[i : i + 1],
            )[0].float()
            for j in range(batch.response_ids.shape[1]):
                if not supervised[i, j]:
                    continue
                target = int(batch.response_ids[i, j])
                w = config.lambda_r if int(batch.roles[i, j]) == REASONING else config.lambda_o
                num += w * float(F.cross_entropy(logits[j], torch.tensor(target, device=DEVICE)))
                den += w
                if int(logits[j].argmax()) == target:
                    p = logits[j].softmax(-1)
                    cert += float(-(p * p.log()).sum())
                    n_correct += 1
    return torch.tensor(num / den + config.certainty * cert / max(n_correct, 1))


@torch.no_grad()
def test_distillation_loss_matches_a_plain_loop() -> None:
    model, _, batch = _recorded_batch()
    config = SupervisedConfig(
        batch_size=4, block_size=K, lambda_r=0.3, lambda_o=1.0, noise="trajectory", certainty=0.7
    )
    loss, metrics = supervised_loss(config, MASK)(model, batch)
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + batch.index)
    noise = cft_noise(
        batch.response_ids, batch.roles, K, MASK, config.eps, gen, "trajectory", batch.commit_steps
    )
    torch.testing.assert_close(loss.cpu(), _loop_reference(model, batch, noise, config), atol=1e-4, rtol=1e-5)
    assert 0 < metrics["correct_share"] <= 1 and metrics["certainty_entropy"] >= 0
    plain, _ = supervised_loss(SupervisedConfig(block_size=K, lambda_r=0.3, noise="trajectory"), MASK)(
        model, batch
    )
    assert float(plain) < float(loss)  # the certainty term adds a positive entropy


def test_token_roles_mark_the_list_from_its_key(task: dict) -> None:  # noqa: F811
    tok = task["tokenizer"]
    row = task["sft"].iloc[0]
    assert token_roles(tok, list(row["response_ids"])) == list(row["response_roles"])


@pytest.fixture(scope="module")
def recorded(task: dict):  # noqa: F811
    tok = task["tokenizer"]
    model = tiny_model_for(tok, K)
    decoding = RerankConfig(max_new_tokens=96, batch_size=4)
    config = TrajectoryConfig(tau=0.5, requests=6, max_target_rank=2, grammar=True)
    return model, record_trajectories(model, tok, task["requests"], decoding, config)


def test_recorded_trajectories_are_served_decodes_kept_by_their_target_rank(recorded) -> None:
    _, frame = recorded
    assert list(frame.columns) == list(TRAJECTORY_COLUMNS) and len(frame) == 6
    assert frame["valid"].all()  # decoded under the answer grammar, as served
    for row in frame.itertuples():
        assert len(row.response_ids) == len(row.commit_steps) == len(row.response_roles)
        assert min(row.commit_steps) >= 1 and row.nfe >= 1
        assert row.kept == (1 <= row.target_rank <= 2)
        assert row.reason == ("" if row.kept else "target_rank>2")
    assert frame["target_rank"].between(1, 4).all()  # 4 candidates, every one ranked


def test_no_kept_trajectory_is_a_clear_error(recorded) -> None:
    _, frame = recorded
    with pytest.raises(ValueError, match=r"no recorded trajectory was kept out of 6 \(set aside"):
        kept_trajectories(frame.assign(kept=False, reason="target_rank>2"))


@pytest.fixture(scope="module")
def own_answers(task: dict):  # noqa: F811
    """An AR model's free answers (expert iteration's recording): no grammar, so some are invalid."""
    tok = task["tokenizer"]
    model = tiny_model_for(tok, 1)
    config = TrajectoryConfig(tau=None, requests=None, max_target_rank=4, grammar=False)
    return record_trajectories(
        model, tok, task["requests"], RerankConfig(max_new_tokens=48, batch_size=4), config
    )


def test_free_recording_sets_its_invalid_answers_aside(task: dict, own_answers) -> None:  # noqa: F811
    frame = own_answers
    assert len(frame) == len(task["requests"])  # None = every request
    assert not frame["valid"].all()  # an untrained model, no grammar: its own answers are not all valid
    invalid = frame[~frame["valid"]]
    assert (~invalid["kept"]).all() and invalid["reason"].str.startswith("invalid:").all()
    assert (frame["kept"] == (frame["valid"] & frame["target_rank"].between(1, 4))).all()


def test_self_training_examples_are_the_examples_then_the_kept_answers(task: dict, own_answers) -> None:  # noqa: F811
    sft = task["sft"]
    answers = own_answers.assign(kept=[i % 2 == 0 for i in range(len(own_answers))])
    mixed = self_training_examples(sft, answers)
    assert list(mixed.columns) == EXAMPLE_COLUMNS and len(mixed) == len(sft) + int(answers["kept"].sum())
    assert mixed["response_ids"].map(list).tolist() == [
        *sft["response_ids"].map(list),
        *answers.loc[answers["kept"], "response_ids"].map(list),
    ]
    # a model with no valid answer of its own yet trains on the examples alone
    assert len(self_training_examples(sft, own_answers.assign(kept=False))) == len(sft)


def test_distillation_resumes_exactly_after_a_crash(task: dict, recorded, tmp_path) -> None:  # noqa: F811
    """Two steps, a lost final checkpoint, a resume into a fresh model: the weights of the run that
    never stopped."""
    tok = task["tokenizer"]
    kept = recorded[1].assign(kept=True)
    config = SupervisedConfig(batch_size=2, block_size=K, noise="trajectory", certainty=1.0)

    def run(out, init_seed: int):
        model = tiny_model_for(tok, K)
        if init_seed:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(init_seed)
        cfg = TrainConfig(output_dir=str(out), max_steps=4, lr=1e-3, checkpoint_every=2, progress=False)
        return model, train(
            model, example_batches(kept, tok.pad_token_id, config), supervised_loss(config, MASK), cfg
        )

    ref, _ = run(tmp_path / "ref", 0)
    run(tmp_path / "crashed", 0)
    shutil.rmtree(tmp_path / "crashed" / "checkpoints" / "step-000004")
    resumed, result = run(tmp_path / "crashed", 1)
    assert result.resumed_from == 2
    for a, b in zip(ref.state_dict().values(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_an_explanation_citing_a_sid_its_prompt_lacks_is_ungrounded(task: dict) -> None:  # noqa: F811
    tok, requests = task["tokenizer"], task["requests"]
    request = next(requests.itertuples(index=False))
    shown = set(cited_sids(tok.decode([int(t) for t in request.prompt_ids])))
    foreign = next(str(s) for sids in requests["candidate_sids"] for s in sids if str(s) not in shown)
    cited = str(request.candidate_sids[0])
    assert cited in shown

    def answer(sid: str) -> str | None:  # the explanation as the parser reads it
        text = f'{{"explanation":"Pick {sid} first.","recommendations":["{foreign}"]}}'
        return parse_answer(text, [str(s) for s in request.candidate_sids]).explanation

    assert grounded(tok, answer(cited), request)  # the list is not the explanation's business
    assert not grounded(tok, answer(foreign), request)


@pytest.mark.parametrize(
    ("keep", "rank", "prerank_rank", "reason"),
    [
        ("any", 5, 2, ""),  # any valid answer within max_target_rank
        ("any", 0, 2, "target_rank>10"),
        ("no_worse", 2, 2, ""),  # a copy ranks the target where the pre-rank did
        ("no_worse", 3, 2, "below_prerank"),
        ("better", 2, 2, "not_above_prerank"),  # a copy where the pre-rank's first item was wrong
        ("better", 1, 2, ""),
        ("better", 1, 1, ""),  # the pre-rank was right and the answer keeps its pick
        ("better", 2, 1, "below_prerank"),
    ],
)
def test_keep_rules_pay_for_moving_the_target_up_not_for_copies(
    keep: str, rank: int, prerank_rank: int, reason: str
) -> None:
    assert rank_reason(rank, prerank_rank, TrajectoryConfig(keep=keep)) == reason


def test_an_unknown_keep_rule_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="trajectories.keep must be one of"):
        TrajectoryConfig(keep="copies")
