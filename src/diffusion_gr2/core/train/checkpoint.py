"""Training checkpoints: written atomically, found again after a crash, pruned to the last few.

A checkpoint is a directory ``<output_dir>/checkpoints/step-NNNNNN/`` holding everything a resumed
run needs to continue *bit for bit* (DESIGN §6 "resume after a crash"): the model weights
(safetensors), optimizer, scheduler and grad-scaler states, the loop's own state (step, metric
history) and the RNG states of every process. The directory is built in a temp folder and renamed
into place (``core/io.py: atomic_directory``), so a directory named ``step-*`` is always complete.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from diffusion_gr2.core.io import atomic_directory

logger = logging.getLogger(__name__)

__all__ = [
    "LoopState",
    "checkpoint_dirs",
    "get_rng_state",
    "latest_checkpoint",
    "load_checkpoint",
    "prune_checkpoints",
    "save_checkpoint",
    "set_rng_state",
]

_STEP_DIR = re.compile(r"^step-(\d{6,})$")  # temp dirs (".step-*.tmp") never match
MODEL_FILE = "model.safetensors"
STATE_FILE = "trainer_state.json"


@dataclass
class LoopState:
    """The loop's own progress: optimizer steps done, one metric dict per step, seconds spent."""

    step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0


def checkpoint_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as ``(step, path)``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    """Newest complete checkpoint under ``root``, or None when there is none."""
    found = checkpoint_dirs(root)
    return found[-1][1] if found else None


def _remove_directory(path: Path) -> None:
    """Rename ``path`` to a hidden name first, so a crash mid-delete never leaves a partial ``step-*``."""
    trash = path.with_name(f".{path.name}.del-{uuid.uuid4().hex[:8]}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def prune_checkpoints(root: str | Path, keep: int) -> None:
    """Delete all but the ``keep`` newest checkpoints (``keep <= 0`` deletes them all)."""
    found = checkpoint_dirs(root)
    for _, path in found[: max(len(found) - max(keep, 0), 0)]:
        _remove_directory(path)
        logger.debug("pruned checkpoint %s", path)


def get_rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU + CUDA) RNG states of this process."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states captured by :func:`get_rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    state: LoopState,
    rng_states: list[dict[str, Any]],
    scaler: Any = None,
) -> Path:
    """Write one complete checkpoint directory atomically; returns its path.

    ``rng_states`` holds one entry per process (index = process rank), gathered by the caller so that
    only the main process writes.
    """
    with atomic_directory(path) as tmp:
        # save_model (not save_file) handles tied weights such as Qwen3's shared embedding/LM head.
        safetensors.torch.save_model(model, str(tmp / MODEL_FILE))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rng_states, tmp / "rng.pt")
        if scaler is not None:
            torch.save(scaler.state_dict(), tmp / "scaler.pt")
        payload = {"step": state.step, "history": state.history, "seconds": state.seconds}
        (tmp / STATE_FILE).write_text(json.dumps(payload, allow_nan=True), encoding="utf-8")
    return Path(path)


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    scaler: Any = None,
) -> tuple[LoopState, list[dict[str, Any]]]:
    """Load a checkpoint into the given objects; returns the loop state and the per-process RNG states."""
    path = Path(path)
    device = next(model.parameters()).device
    safetensors.torch.load_model(model, str(path / MODEL_FILE), strict=True, device=str(device))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    if scaler is not None and (path / "scaler.pt").exists():
        scaler.load_state_dict(torch.load(path / "scaler.pt", weights_only=True))
    # Our own file: the python/numpy RNG states are tuples with arrays, which weights_only refuses.
    rng_states = torch.load(path / "rng.pt", weights_only=False)
    payload = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    state = LoopState(int(payload["step"]), list(payload["history"]), float(payload.get("seconds", 0.0)))
    return state, rng_states
