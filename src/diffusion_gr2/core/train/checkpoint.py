"""Training checkpoints: accelerate's own state, written atomically, checked before use, pruned.

A checkpoint is a directory ``<output_dir>/checkpoints/step-NNNNNN/`` holding everything a resumed
run needs to continue *bit for bit* (docs/architecture.md#training-stages, "Checkpoints and resume"): what
``Accelerator.save_state`` writes (weights as safetensors, or one shard per process under FSDP; optimizer,
scheduler, grad scaler; the RNG states of every process) and the loop's own state (step, metric history,
process count). Every process writes its part into ``.step-NNNNNN.tmp``; once all have, the main process adds
``manifest.json`` (each file's size and SHA-256, so that later damage — a disk error, a truncating copy,
a hand edit — is found before anything is loaded), fsyncs and renames it into place
(``core/io.py: publish_directory``): a directory named ``step-*`` is complete when written.

Resume (`restore_latest`) has the main process read and check the newest checkpoint completely before
any process loads it; an unusable one is renamed ``step-NNNNNN.corrupt`` (out of the resume and pruning
order) with a warning, and the next older one is tried. `content_fingerprint` names a run's checkpoint
folder by the bytes of what it depends on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
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
from accelerate.utils import broadcast_object_list

from diffusion_gr2.core.io import publish_directory

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointError",
    "LoopState",
    "checkpoint_dirs",
    "content_fingerprint",
    "latest_checkpoint",
    "prune_checkpoints",
    "read_checkpoint",
    "remove_stale_temp_dirs",
    "restore_latest",
    "save_checkpoint",
    "verify_checkpoint",
]

_STEP_DIR = re.compile(r"^step-(\d{6,})$")  # temp dirs (".step-*.tmp") never match
_TEMP_DIR = re.compile(r"^\.step-\d{6,}\.(?:.*\.)?(?:tmp|del-[0-9a-f]+)$")  # a killed write or delete
# accelerate's file names (accelerate.utils.constants); FSDP writes folders instead of the two files
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.bin"
SCHEDULER_FILE = "scheduler.bin"
FSDP_MODEL_DIR = "pytorch_model_fsdp_0"
FSDP_OPTIMIZER_DIR = "optimizer_0"
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the directory, the file and what is wrong."""


@dataclass
class LoopState:
    """The loop's own progress: optimizer steps done, one metric dict per step, seconds spent, and the
    number of processes that wrote it (accelerate's state is per process: it resumes with as many)."""

    step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0
    world_size: int = 1


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


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _files(folder: Path) -> list[Path]:
    """Every file under ``folder`` (FSDP shards live in sub-folders), in a stable order."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def _write_manifest(folder: Path) -> None:
    """Size and SHA-256 of every file under ``folder``; written last, so it covers all of them."""
    files = {
        p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in _files(folder)
    }
    (folder / MANIFEST_FILE).write_text(json.dumps({"files": files}, indent=1), encoding="utf-8")


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Raise logger ``name`` to ERROR for the duration (a warning about what is expected)."""
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def save_checkpoint(path: str | Path, accelerator: Any, state: LoopState) -> Path:
    """Write one complete checkpoint directory atomically, with every process; returns its path.

    ``accelerator`` holds the prepared model, optimizer and scheduler. Every process must call this
    (each writes its RNG state, and under FSDP its shards); the main process publishes the folder.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")  # one name all processes agree on without talking
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    with _quiet("accelerate.utils.other"):  # "Removed shared tensor": Qwen3's tied LM head, stored once
        accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        payload = {
            "step": state.step,
            "history": state.history,
            "seconds": state.seconds,
            "world_size": accelerator.num_processes,
        }
        (tmp / STATE_FILE).write_text(json.dumps(payload, allow_nan=True), encoding="utf-8")
        _write_manifest(tmp)
        publish_directory(tmp, path)
    accelerator.wait_for_everyone()
    return path


def _required(names: set[str]) -> list[str]:
    """What a checkpoint must list: the loop state, weights, optimizer, scheduler, RNG states."""
    missing = [n for n in (STATE_FILE, SCHEDULER_FILE) if n not in names]
    for file, folder in ((MODEL_FILE, FSDP_MODEL_DIR), (OPTIMIZER_FILE, FSDP_OPTIMIZER_DIR)):
        if file not in names and not any(n.startswith(folder + "/") for n in names):
            missing.append(file)
    if not any(n.startswith("random_states_") for n in names):
        missing.append("random_states_<process>.pkl")
    return missing


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
    missing = _required(set(expected))
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


def _read(path: Path, what: str, read: Any) -> Any:
    """``read()``, with any failure turned into a `CheckpointError` naming the file."""
    try:
        return read()
    except Exception as err:  # torch.load and safetensors raise many types on a damaged file
        raise CheckpointError(f"{path / what}: cannot be read ({type(err).__name__}: {err})") from None


def _check_model_keys(path: Path, model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """The saved tensors must match the model: no unknown key, no wrong shape, nothing missing except
    tied aliases (safetensors stores one name per shared storage)."""
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


def read_checkpoint(path: str | Path, model: torch.nn.Module | None = None) -> LoopState:
    """Verify and read a checkpoint completely, without loading it anywhere; its loop state.

    ``model`` is the prepared model the weights must fit (keys and shapes). Under FSDP the shards are
    checked by the manifest only (reading them is a collective of every process).
    """
    path = Path(path)
    verify_checkpoint(path)
    if (path / MODEL_FILE).is_file():
        tensors = _read(path, MODEL_FILE, lambda: safetensors.torch.load_file(path / MODEL_FILE))
        if model is not None:
            _check_model_keys(path, model, tensors)
    for name in (OPTIMIZER_FILE, SCHEDULER_FILE):
        if (path / name).is_file():
            _read(
                path, name, lambda name=name: torch.load(path / name, map_location="cpu", weights_only=True)
            )
    for rng in sorted(path.glob("random_states_*.pkl")):
        # accelerate's torch.save of the python/numpy/torch RNG states (it loads them the same way)
        _read(path, rng.name, lambda rng=rng: torch.load(rng, map_location="cpu", weights_only=False))
    payload = _read(path, STATE_FILE, lambda: json.loads((path / STATE_FILE).read_text(encoding="utf-8")))
    return _read(
        path,
        STATE_FILE,
        lambda: LoopState(
            int(payload["step"]),
            list(payload["history"]),
            float(payload.get("seconds", 0.0)),
            int(payload.get("world_size", 1)),
        ),
    )


def _quarantine(path: Path) -> Path:
    """Move an unusable checkpoint out of the ``step-*`` names (kept for inspection, never resumed)."""
    target = path.with_name(f"{path.name}.corrupt")
    if target.exists():
        target = path.with_name(f"{path.name}.corrupt-{uuid.uuid4().hex[:8]}")
    os.replace(path, target)
    return target


def _newest_usable(root: Path, model: torch.nn.Module | None) -> tuple[Path, LoopState] | None:
    """The newest checkpoint that reads and checks in full; damaged ones are moved aside on the way."""
    for _, path in reversed(checkpoint_dirs(root)):
        try:
            return path, read_checkpoint(path, model)
        except CheckpointError as err:
            moved = _quarantine(path)
            logger.warning(
                "unusable checkpoint skipped (%s); moved to %s; trying an older one", err, moved.name
            )
    return None


def restore_latest(root: str | Path, accelerator: Any) -> tuple[Path, LoopState] | None:
    """Load the newest usable checkpoint under ``root`` into the accelerator's objects; None when none.

    Every process must call this. The main process picks the checkpoint (a damaged one never blocks a
    resume: it is logged, renamed aside and the next older one is tried) and tells the others; nothing
    is loaded until it has been read and checked in full. A checkpoint written by another number of
    processes is refused with a `CheckpointError` (accelerate's state is per process).
    """
    choice: list[Any] = [None]
    if accelerator.is_main_process:
        model = accelerator._models[0] if accelerator._models else None
        found = _newest_usable(Path(root), model)
        choice = [None if found is None else (str(found[0]), found[1])]
    if accelerator.num_processes > 1:
        choice = broadcast_object_list(choice)
    if choice[0] is None:
        return None
    path, state = Path(choice[0][0]), choice[0][1]
    if state.world_size != accelerator.num_processes:
        raise CheckpointError(
            f"{path}: written by {state.world_size} process(es), this run has {accelerator.num_processes}: "
            f"relaunch with {state.world_size}, or set train.resume=false to start this stage afresh"
        )
    accelerator.load_state(str(path))
    return path, state


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
