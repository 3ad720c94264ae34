"""What every training node shares: the run directory, MLflow step metrics and a short summary."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from diffusion_gr2.core.tracking.mlflow_utils import MlflowTracker
from diffusion_gr2.core.train.loop import TrainConfig, train


def fingerprint(params: dict[str, Any], model: torch.nn.Module, *frames: pd.DataFrame) -> str:
    """Hash of what a training run depends on, so a resume never picks up another run's checkpoint."""
    digest = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode())
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().float().sum().numpy().tobytes())
    for frame in frames:
        digest.update(pd.util.hash_pandas_object(frame.astype(str), index=False).to_numpy().tobytes())
    return digest.hexdigest()[:12]


def train_stage(
    stage: str,
    model: torch.nn.Module,
    make_batch: Callable,
    loss_fn: Callable,
    params: dict[str, Any],
    *frames: pd.DataFrame,
) -> dict[str, Any]:
    """Train ``model`` in place on the shared loop; checkpoints live under a fingerprinted folder."""
    run_dir = Path(params["checkpoint_root"]) / stage / fingerprint(params, model, *frames)
    config = TrainConfig(output_dir=str(run_dir), **params["train"])
    start = time.perf_counter()
    result = train(model, make_batch, loss_fn, config, MlflowTracker(stage))
    model.eval()
    return {
        **{f"final_{k}": v for k, v in result.final_metrics.items()},
        "steps": result.steps,
        "resumed_from_step": result.resumed_from or 0,
        "train_seconds": round(time.perf_counter() - start, 1),
    }
