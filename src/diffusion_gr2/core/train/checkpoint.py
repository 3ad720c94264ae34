"""Training checkpoints: written atomically, found again after a crash, pruned to the last few.

A checkpoint is a directory ``<output_dir>/checkpoints/step-NNNNNN/`` holding everything a resumed
run needs to continue *bit for bit* (DESIGN §6 "resume after a crash"): the model weights
(safetensors), optimizer, scheduler and grad-scaler states, the loop's own state (step, metric
history) and the RNG states of every process. The directory is built in a temp folder, fsynced and
renamed into place (``core/io.py: atomic_directory``), so a directory named ``step-*`` is complete
when written; ``manifest.json`` records each file's size and SHA-256 so that later damage (a disk
error, a truncating copy, a hand edit) is found before anything is loaded.

Resume (`restore_latest`) reads and checks the newest checkpoint completely before touching the model;
an unusable one is renamed ``step-NNNNNN.corrupt`` (out of the resume and pruning order) with a
warning, and the next older one is tried. `content_fingerprint` names a run's checkpoint folder by the
bytes of what it depends on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import safetensors.torch
import torch

from diffusion_gr2.core.io import atomic_directory

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointData",
    "CheckpointError",
    "LoopState",
    "apply_checkpoint",
    "checkpoint_dirs",
    "content_fingerprint",
    "get_rng_state",
    "latest_checkpoint",
    "load_checkpoint",
    "prune_checkpoints",
    "read_checkpoint",
    "remove_stale_temp_dirs",
    "restore_latest",
    "save_checkpoint",
    "set_rng_state",
    "verify_checkpoint",
]

_STEP_DIR = re.compile(r"^step-(\d{6,})$")  # temp dirs (".step-*.tmp") never match
_TEMP_DIR = re.compile(r"^\.step-\d{6,}\.(?:.*\.)?(?:tmp|del-[0-9a-f]+)$")  # a killed write or delete
MODEL_FILE = "model.safetensors"
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
REQUIRED_FILES = (MODEL_FILE, "optimizer.pt", "scheduler.pt", "rng.pt", STATE_FILE)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the directory, the file and what is wrong."""


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


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _write_manifest(folder: Path) -> None:
    """Size and SHA-256 of every file in ``folder``; written last, so it covers all of them."""
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(folder.iterdir())
        if p.is_file()
    }
    (folder / MANIFEST_FILE).write_text(json.dumps({"files": files}, indent=1), encoding="utf-8")


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
        _write_manifest(tmp)
    return Path(path)


def verify_checkpoint(path: str | Path) -> None:
    """Raise `CheckpointError` unless every file of the manifest is present with its size and hash."""
    path = Path(path)
    try:
        files = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))["files"]
        expected = {name: (int(entry["bytes"]), str(entry["sha256"])) for name, entry in files.items()}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"{path / MANIFEST_FILE}: unreadable manifest ({type(err).__name__}: {err})"
        ) from None
    missing = [name for name in REQUIRED_FILES if name not in expected]
    if missing:
        raise CheckpointError(f"{path / MANIFEST_FILE}: lists no {missing}")
    for name, (size, digest) in expected.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing")
        if file.stat().st_size != size:
            raise CheckpointError(
                f"{file}: {file.stat().st_size} bytes, the manifest says {size} (truncated?)"
            )
        if _sha256(file) != digest:
            raise CheckpointError(f"{file}: content differs from the manifest's SHA-256 (damaged)")


@dataclass
class CheckpointData:
    """Everything a checkpoint holds, read and checked, not yet applied to any object."""

    path: Path
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    scaler: dict[str, Any] | None
    rng_states: list[dict[str, Any]]
    state: LoopState


def _read(path: Path, what: str, read: Any) -> Any:
    """``read()``, with any failure turned into a `CheckpointError` naming the file."""
    try:
        return read()
    except Exception as err:  # torch.load and safetensors raise many types on a damaged file
        raise CheckpointError(f"{path / what}: cannot be read ({type(err).__name__}: {err})") from None


def _check_model_keys(path: Path, model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """The saved tensors must match the model: no unknown key, no wrong shape, nothing missing except
    tied aliases (``save_model`` stores one name per shared storage)."""
    expected = model.state_dict()
    unexpected = sorted(set(tensors) - set(expected))
    shapes = sorted(k for k in tensors if k in expected and tensors[k].shape != expected[k].shape)
    saved_storage = {expected[k].data_ptr() for k in tensors if k in expected}
    missing = sorted(k for k in expected if k not in tensors and expected[k].data_ptr() not in saved_storage)
    if unexpected or shapes or missing:
        raise CheckpointError(
            f"{path / MODEL_FILE}: does not fit the model (unexpected {unexpected[:5]}, "
            f"wrong shape {shapes[:5]}, missing {missing[:5]})"
        )


def read_checkpoint(path: str | Path, model: torch.nn.Module) -> CheckpointData:
    """Verify and read a checkpoint completely; raises `CheckpointError` and changes nothing if unusable."""
    path = Path(path)
    verify_checkpoint(path)
    device = next(model.parameters()).device
    tensors = _read(
        path, MODEL_FILE, lambda: safetensors.torch.load_file(path / MODEL_FILE, device=str(device))
    )
    _check_model_keys(path, model, tensors)

    def torch_file(name: str, **kwargs: Any) -> Any:
        return _read(path, name, lambda: torch.load(path / name, **kwargs))

    payload = _read(path, STATE_FILE, lambda: json.loads((path / STATE_FILE).read_text(encoding="utf-8")))
    state = _read(
        path,
        STATE_FILE,
        lambda: LoopState(int(payload["step"]), list(payload["history"]), float(payload.get("seconds", 0.0))),
    )
    return CheckpointData(
        path=path,
        model=tensors,
        optimizer=torch_file("optimizer.pt", map_location=device, weights_only=True),
        scheduler=torch_file("scheduler.pt", weights_only=True),
        scaler=torch_file("scaler.pt", weights_only=True) if (path / "scaler.pt").exists() else None,
        # Our own file: the python/numpy RNG states are tuples with arrays, which weights_only refuses.
        rng_states=torch_file("rng.pt", weights_only=False),
        state=state,
    )


def apply_checkpoint(
    data: CheckpointData, model: torch.nn.Module, optimizer: Any, scheduler: Any, scaler: Any = None
) -> tuple[LoopState, list[dict[str, Any]]]:
    """Load checked checkpoint contents into the objects; returns the loop state and per-process RNG states."""
    model.load_state_dict(data.model, strict=False)  # keys checked in `read_checkpoint` (tied aliases)
    optimizer.load_state_dict(data.optimizer)
    scheduler.load_state_dict(data.scheduler)
    if scaler is not None and data.scaler is not None:
        scaler.load_state_dict(data.scaler)
    return data.state, data.rng_states


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    scaler: Any = None,
) -> tuple[LoopState, list[dict[str, Any]]]:
    """Load a checkpoint into the given objects; returns the loop state and the per-process RNG states.

    Raises `CheckpointError` (naming the file) before changing anything when the checkpoint is unusable.
    """
    return apply_checkpoint(read_checkpoint(path, model), model, optimizer, scheduler, scaler)


def _quarantine(path: Path) -> Path:
    """Move an unusable checkpoint out of the ``step-*`` names (kept for inspection, never resumed)."""
    target = path.with_name(f"{path.name}.corrupt")
    if target.exists():
        target = path.with_name(f"{path.name}.corrupt-{uuid.uuid4().hex[:8]}")
    os.replace(path, target)
    return target


def restore_latest(
    root: str | Path,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    scaler: Any = None,
    quarantine: bool = True,
) -> tuple[Path, LoopState, list[dict[str, Any]]] | None:
    """Load the newest usable checkpoint under ``root``; None when there is none.

    A damaged checkpoint never blocks a resume: it is logged, renamed aside (when ``quarantine``:
    only the main process of a multi-process run renames) and the next older one is tried. Nothing
    is loaded into the objects until a checkpoint has been read and checked in full.
    """
    for _, path in reversed(checkpoint_dirs(root)):
        try:
            data = read_checkpoint(path, model)
        except CheckpointError as err:
            moved = _quarantine(path) if quarantine else path
            logger.warning(
                "unusable checkpoint skipped (%s); moved to %s; trying an older one", err, moved.name
            )
            continue
        state, rng_states = apply_checkpoint(data, model, optimizer, scheduler, scaler)
        return path, state, rng_states
    return None


def remove_stale_temp_dirs(root: str | Path) -> list[Path]:
    """Delete the half-written temp folders a killed process left under ``root``; returns them."""
    root = Path(root)
    stale = [p for p in root.iterdir() if p.is_dir() and _TEMP_DIR.match(p.name)] if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
        logger.info("removed %s, left by an interrupted checkpoint write", path)
    return stale


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of a tensor on any device and of any dtype (bf16 included)."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _cell_json(value: Any) -> Any:
    """A frame cell as a JSON-able value: arrays and numpy scalars as Python lists and numbers."""
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if isinstance(value, list | tuple):
        return [_cell_json(v) for v in value]
    return value


def _frame_chunks(frame: pd.DataFrame) -> Iterator[bytes]:
    """A canonical byte stream of a frame: column names and dtypes, then every value in full.

    Numeric columns contribute their buffers; object cells their JSON text (exact: floats by repr,
    lists in full), never ``str()``, which numpy shortens to ``[1 2 ... 9]`` for long arrays.
    """
    yield json.dumps([[str(c), str(t)] for c, t in frame.dtypes.items()]).encode()
    for name in frame.columns:
        column = frame[name]
        if column.dtype.kind in "biufcmM":
            yield np.ascontiguousarray(column.to_numpy()).tobytes()
        else:
            for value in column:
                yield json.dumps(_cell_json(value), default=str).encode() + b"\n"


def content_fingerprint(params: Mapping[str, Any], model: torch.nn.Module, *frames: pd.DataFrame) -> str:
    """12 hex digits of SHA-256 over the parameters, the model's tensors and the frames, all as bytes.

    Two runs share a checkpoint folder only if they would train the same thing: weights are hashed
    by name, dtype, shape and bytes (per-tensor sums miss a permutation), frames by `_frame_chunks`.
    """
    digest = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode())
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(_tensor_bytes(tensor))
    for frame in frames:
        digest.update(f"frame|{len(frame)}".encode())
        for chunk in _frame_chunks(frame):
            digest.update(chunk)
    return digest.hexdigest()[:12]
