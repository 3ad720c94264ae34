"""Run by ``torchrun`` from test_loop_multiprocess.py: trains a tiny MLP and saves each rank's weights.

Self-contained (no transformers import) so that process start-up stays short.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch

from diffusion_gr2.core.train.loop import TrainConfig, train


def make_batch(index: int, model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + index)
    x = torch.randn(6, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def mse_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y), {}


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def config(out: str, grad_accum: int) -> TrainConfig:
    return TrainConfig(
        output_dir=out,
        lr=3e-2,
        max_steps=6,
        grad_accum=grad_accum,
        checkpoint_every=3,
        cpu=True,
        progress=False,
    )


if __name__ == "__main__":
    # Full run, then (same process group) drop the last checkpoint and resume from step 3 into a
    # differently initialised model: both must end with the same weights.
    torch.set_num_threads(1)
    out, rank = sys.argv[1], os.environ.get("RANK", "0")
    model = mlp(0)
    train(model, make_batch, mse_loss, config(out, 1))
    torch.save(model.state_dict(), Path(out) / f"weights_{rank}.pt")
    torch.distributed.barrier()
    if rank == "0":
        shutil.rmtree(Path(out) / "checkpoints" / "step-000006")
    torch.distributed.barrier()
    resumed = mlp(1)
    result = train(resumed, make_batch, mse_loss, config(out, 1))
    assert result.resumed_from == 3, result.resumed_from
    torch.save(resumed.state_dict(), Path(out) / f"resumed_{rank}.pt")
