"""Rollout stages under FSDP2, on two gloo processes: the sharded model decodes token for token what the
unsharded one does, and RL and OPD steps through the shared loop end with the DDP steps' weights.

accelerate 1.15 enables FSDP on GPU distributed types only; torch's ``fully_shard`` runs on gloo, so the
workers set the state accelerate's GPU branch sets (``AcceleratorState.__init__``: FSDP, an FSDP2
plugin wrapping each Qwen3 decoder layer) and the loop prepares the model through accelerate's own
FSDP2 path. The two processes decode different requests with different token budgets, so they run
different numbers of forwards, in the decoder and in the losses' replays, which FSDP's per-call
gathering could not survive.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Weights after the same steps under FSDP and DDP: the same maths, but FSDP reduce-scatters and DDP
# all-reduces the gradients (another summation order), and AdamW's first steps scale every gradient
# to about lr, so a rounding difference of a small gradient moves a weight by up to ~1e-6 x lr.
WEIGHT_ATOL = 1e-6

RL_STEPS = 2  # step 2 empties rank 1's micro-batch (no kept rollout): the zero loss under FSDP


def _force_fsdp(acc):  # noqa: ANN001, ANN202 (an Accelerator, returned)
    """Put ``acc`` in the FSDP2 state accelerate sets on GPUs (conf/accelerate/fsdp.yaml's wrapping)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Qwen3DecoderLayer"],
        state_dict_type="SHARDED_STATE_DICT",
        reshard_after_forward=True,
    )
    AcceleratorState._shared_state.update(distributed_type=DistributedType.FSDP, fsdp_plugin=plugin)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState does
    return acc


def _sharded_rollouts(task: dict, rank: int, out: Path) -> None:
    """Rollouts of a hand-sharded policy (accelerate's layout) inside `full_weights` vs the unsharded."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from diffusion_gr2.core.train.fsdp import full_weights, held_units
    from diffusion_gr2.core.train.loop import LossModule
    from diffusion_gr2.core.train.stages import RolloutConfig, sample_rollouts
    from tests.core.model.tiny import tiny_model_for

    tok, found = task["tokenizer"], {}
    requests = task["requests"].iloc[[2 * rank, 2 * rank + 1]]  # each process its own requests
    for block_size, constrained in ((1, False), (4, False), (4, True)):
        torch.manual_seed(0)
        model = tiny_model_for(tok, block_size if block_size > 1 else None, num_layers=2)
        reference = copy.deepcopy(model)
        wrapped = LossModule(model, lambda m, b: (torch.zeros(()), {}))
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(wrapped)
        held = held_units(wrapped)
        budget = 48 - 8 * rank
        config = RolloutConfig(group_size=2, max_new_tokens=budget, threshold=0.5, constrained=constrained)
        sharded_between = all(isinstance(p, DTensor) for p in model.parameters())
        with full_weights(held):  # the decoder's lean forward reads the layers' weights, past FSDP's hooks
            sharded = sample_rollouts(model, tok, requests, config, seed=rank).outputs
        unsharded = sample_rollouts(reference, tok, requests, config, seed=rank).outputs
        found[f"{block_size}-{constrained}"] = {
            "units": len(held),
            "sharded_before_and_after": sharded_between
            and all(isinstance(p, DTensor) for p in model.parameters()),
            "tokens": [o.tokens for o in sharded],
            "logprobs": [o.token_logprobs for o in sharded],
            "reference_tokens": [o.tokens for o in unsharded],
            "reference_logprobs": [o.token_logprobs for o in unsharded],
        }
    torch.save(found, out / f"rollouts{rank}.pt")


def _emptied(make_batch, rank: int):  # noqa: ANN001, ANN202 (the loop's make_batch, wrapped)
    """Rank 1's micro-batch of the last step without its kept rollouts (the zero-loss path)."""

    def batch(index: int, model: torch.nn.Module):  # noqa: ANN202
        out = make_batch(index, model)
        return dataclasses.replace(out, rows=[]) if rank == 1 and index // 2 == RL_STEPS - 1 else out

    return batch


def _stages(task: dict, rank: int, out: Path) -> None:
    """Diffusion RL (two steps) and OPD (one step) through the loop, under DDP and then FSDP."""
    import diffusion_gr2.core.train.loop as loop
    from diffusion_gr2.core.train.grpo import GRPOConfig
    from diffusion_gr2.core.train.stages import RolloutConfig, opd_batches, opd_loss, rl_batches, rl_loss
    from tests.core.model.tiny import tiny_model_for

    tok, requests, found = task["tokenizer"], task["requests"], {}
    # under the grammar every rollout ranks, so rewards differ within a group and groups are kept
    # and each process its own budget, so they decode and replay different numbers of forwards
    rollout = RolloutConfig(
        prompts_per_step=4, group_size=4, max_new_tokens=64 - 16 * rank, threshold=0.5, constrained=True
    )
    free = RolloutConfig(prompts_per_step=2, group_size=2, max_new_tokens=32 - 8 * rank, threshold=0.5)
    make_accelerator = loop._make_accelerator
    for mode in ("ddp", "fsdp"):
        if mode == "fsdp":
            loop._make_accelerator = lambda config: _force_fsdp(make_accelerator(config))
        for stage in ("rl", "opd"):
            torch.manual_seed(0)
            teacher, model = tiny_model_for(tok, num_layers=2), tiny_model_for(tok, 4, num_layers=2)
            if stage == "rl":
                # old log-probs recomputed: a transformers forward inside make_batch, before the root's
                grpo = GRPOConfig(0.2, 0.2, mini_batches=1, recompute_old_logprobs=True)
                make_batch = _emptied(rl_batches(tok, requests, rollout, grpo, 1, 2), rank)
                loss_fn, steps = rl_loss(tok.pad_token_id, grpo), RL_STEPS
            else:
                make_batch, loss_fn, steps = (
                    opd_batches(teacher, tok, requests, free, 1, 2),
                    opd_loss(tok.pad_token_id),
                    1,
                )
            before = {k: v.detach().clone() for k, v in model.state_dict().items()}
            calls: list[int] = []  # the first layer's forwards through its module (the loss's replay)
            model.model.layers[0].register_forward_hook(lambda *_, calls=calls: calls.append(1))
            config = loop.TrainConfig(
                output_dir=str(out / f"{mode}-{stage}-{rank}"), lr=3e-2, max_steps=steps, checkpoint_every=0,
                resume=False, cpu=True, progress=False,
            )  # fmt: skip
            result = loop.train(model, make_batch, loss_fn, config, decodes=True)
            weights = result.full_state_dict or {k: v.detach().cpu() for k, v in model.state_dict().items()}
            found[f"{mode}-{stage}"] = {
                "sharded": result.full_state_dict is not None,
                "before": before,
                "after": weights,
                "history": result.history,
                "forwards": len(calls),
            }
    torch.save(found, out / f"stages{rank}.pt")


def _rank(rank: int, port: int, out: str) -> None:
    os.environ |= {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=300))
    from tests.core.train.test_stages import make_task

    task = make_task()
    _sharded_rollouts(task, rank, Path(out))
    _stages(task, rank, Path(out))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_rank, args=(port, str(out)), nprocs=2, join=True, start_method="spawn")
    return out


@pytest.mark.parametrize("rank", [0, 1])
def test_a_sharded_policy_decodes_token_for_token_what_the_unsharded_one_does(
    launched: Path, rank: int
) -> None:
    found = torch.load(launched / f"rollouts{rank}.pt")
    other = torch.load(launched / f"rollouts{1 - rank}.pt")
    for name, run in found.items():
        assert run["units"] == 3 and run["sharded_before_and_after"], name  # root + two decoder layers
        assert run["tokens"] == run["reference_tokens"], name
        assert run["logprobs"] == run["reference_logprobs"], name  # the same weights, gathered: bit for bit
    # the processes decoded to different lengths (their budgets differ), so different numbers of forwards
    longest = {n: (max(map(len, found[n]["tokens"])), max(map(len, other[n]["tokens"]))) for n in found}
    assert all(mine != theirs for mine, theirs in longest.values()), longest


@pytest.mark.parametrize("stage", ["rl", "opd"])
def test_an_fsdp_step_of_a_rollout_stage_ends_with_the_ddp_steps_weights(launched: Path, stage: str) -> None:
    ranks = [torch.load(launched / f"stages{r}.pt", weights_only=False) for r in (0, 1)]
    ddp, fsdp = ranks[0][f"ddp-{stage}"], ranks[0][f"fsdp-{stage}"]
    assert fsdp["sharded"] and not ddp["sharded"]
    assert fsdp["forwards"] != ranks[1][f"fsdp-{stage}"]["forwards"]  # the losses' replays differ
    assert ranks[1][f"fsdp-{stage}"]["after"].keys() == fsdp["after"].keys()  # every process gathers
    assert ddp["after"].keys() == fsdp["after"].keys()
    moved = max((ddp["after"][k] - ddp["before"][k]).abs().max().item() for k in ddp["after"])
    assert moved > 1e-3  # the step trained
    for key, weight in ddp["after"].items():
        torch.testing.assert_close(fsdp["after"][key], weight, rtol=0, atol=WEIGHT_ATOL, msg=key)
    for a, b in zip(ddp["history"], fsdp["history"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    if stage == "rl":  # step 2 trained on rank 0's rollouts alone (rank 1's micro-batch was emptied)
        assert fsdp["history"][0]["kept_groups"] > 0
