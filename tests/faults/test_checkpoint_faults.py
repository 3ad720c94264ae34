"""Damaged checkpoints never block a resume; fingerprints see content; directory writes are fsynced."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import safetensors.torch
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from diffusion_gr2.core import io
from diffusion_gr2.core.train.checkpoint import (
    LoopState,
    _write_manifest,
    checkpoint_dirs,
    content_fingerprint,
    remove_stale_temp_dirs,
    restore_latest,
    save_checkpoint,
)

STEPS = (4, 6)  # checkpoints written; 6 is the newest, the one each case damages


def _objects(seed: int, width: int = 8) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))


def _accelerated(seed: int, width: int = 8) -> tuple[Accelerator, torch.nn.Module, object]:
    """A one-process accelerator holding a fresh model, optimizer and scheduler (what the loop saves)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True)
    model, optimizer, scheduler = acc.prepare(*_objects(seed, width))
    return acc, model, scheduler


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: object) -> None:
    model(torch.randn(5, 4)).pow(2).mean().backward()
    optimizer.step()
    scheduler.step()  # type: ignore[attr-defined]
    optimizer.zero_grad()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``checkpoints/step-000004`` and ``step-000006`` of a tiny run."""
    root = tmp_path_factory.mktemp("run") / "checkpoints"
    acc, model, scheduler = _accelerated(0)
    for step in range(1, max(STEPS) + 1):
        _step(model, acc._optimizers[0], scheduler)
        if step in STEPS:
            save_checkpoint(root / f"step-{step:06d}", acc, LoopState(step))
    return root


def _truncate(name: str, keep: float) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        path = folder / name
        path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])

    return damage


def _flip_byte(name: str) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        data = bytearray((folder / name).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (folder / name).write_bytes(bytes(data))

    return damage


def _delete(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).unlink()


def _other_model(folder: Path) -> None:
    """A complete, consistent checkpoint of a differently shaped model (manifest valid)."""
    shutil.rmtree(folder)
    save_checkpoint(folder, _accelerated(1, width=16)[0], LoopState(6))


def _garbage_behind_manifest(folder: Path) -> None:
    """optimizer.bin replaced by garbage and the manifest rewritten to match: the read itself must fail."""
    (folder / "optimizer.bin").write_bytes(b"not a torch file")
    (folder / "manifest.json").unlink()
    _write_manifest(folder)


# (case id, damage, file the warning must name)
DAMAGES = [
    ("model_truncated", _truncate("model.safetensors", 0.5), "model.safetensors"),
    ("model_zero_bytes", _truncate("model.safetensors", 0.0), "model.safetensors"),
    ("optimizer_truncated", _truncate("optimizer.bin", 0.5), "optimizer.bin"),
    ("optimizer_zero_bytes", _truncate("optimizer.bin", 0.0), "optimizer.bin"),
    ("state_zero_bytes", _truncate("trainer_state.json", 0.0), "trainer_state.json"),
    ("state_byte_flipped", _flip_byte("trainer_state.json"), "trainer_state.json"),
    ("rng_byte_flipped", _flip_byte("random_states_0.pkl"), "random_states_0.pkl"),
    ("scheduler_missing", _delete("scheduler.bin"), "scheduler.bin"),
    ("manifest_missing", _delete("manifest.json"), "manifest.json"),
    ("manifest_garbage", _truncate("manifest.json", 0.3), "manifest.json"),
    ("other_model_shape", _other_model, "model.safetensors"),
    ("garbage_behind_valid_manifest", _garbage_behind_manifest, "optimizer.bin"),
]


@pytest.mark.parametrize(("damage", "named"), [d[1:] for d in DAMAGES], ids=[d[0] for d in DAMAGES])
def test_damaged_newest_checkpoint_falls_back_to_the_older_one(
    saved: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Callable[[Path], None], named: str
) -> None:
    root = tmp_path / "checkpoints"
    shutil.copytree(saved, root)
    damage(root / "step-000006")
    acc, model, scheduler = _accelerated(99)
    with caplog.at_level(logging.WARNING):
        restored = restore_latest(root, acc)
    assert restored is not None
    path, state = restored
    assert path.name == "step-000004" and state.step == 4
    expected = safetensors.torch.load_file(saved / "step-000004" / "model.safetensors")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    assert scheduler.scheduler.last_epoch == 4  # type: ignore[attr-defined]
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"step-000006/{named}" in warning
    assert [s for s, _ in checkpoint_dirs(root)] == [4] and (root / "step-000006.corrupt").is_dir()


def test_all_checkpoints_damaged_starts_fresh_with_model_untouched(saved: Path, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    shutil.copytree(saved, root)
    for step in STEPS:
        _truncate("model.safetensors", 0.5)(root / f"step-{step:06d}")
    acc, model, _ = _accelerated(99)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert restore_latest(root, acc) is None
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert checkpoint_dirs(root) == []


def test_stale_temp_folders_of_a_killed_write_are_removed(tmp_path: Path) -> None:
    stale = [tmp_path / ".step-000008.k2j3x.tmp", tmp_path / ".step-000002.del-0a1b2c3d"]
    kept = [tmp_path / "step-000004", tmp_path / ".step-000004.old-0a1b2c3d", tmp_path / "notes"]
    for path in stale + kept:
        path.mkdir()
    assert sorted(remove_stale_temp_dirs(tmp_path)) == sorted(stale)
    assert all(p.exists() for p in kept) and not any(p.exists() for p in stale)


# ---- fingerprints --------------------------------------------------------------------------------
def _permuted(model: torch.nn.Module) -> torch.nn.Module:
    """Same per-tensor sums, different function: the first layer's weights permuted."""
    clone = _objects(0)[0]
    clone.load_state_dict(model.state_dict())
    with torch.no_grad():
        clone[0].weight.copy_(clone[0].weight.flatten().flip(0).reshape(clone[0].weight.shape))
    return clone


def _long_arrays(middle: int) -> pd.DataFrame:
    """numpy's str() shows ``[0 1 2 ... 997 998 999]`` for both values of ``middle``."""
    values = np.arange(2000)
    values[1000] = middle
    return pd.DataFrame({"ids": [values]})


FINGERPRINT_CASES = [
    ("permuted_weights", lambda m: (m, []), lambda m: (_permuted(m), []), False),
    ("long_array_cells", lambda m: (m, [_long_arrays(1000)]), lambda m: (m, [_long_arrays(-7)]), False),
    ("float_cells", lambda m: (m, [pd.DataFrame({"x": [[0.1]]})]), lambda m: (m, [pd.DataFrame({"x": [[0.1 + 2**-56]]})]), False),
    ("list_vs_array_same_values", lambda m: (m, [pd.DataFrame({"x": [[1, 2]]})]), lambda m: (m, [pd.DataFrame({"x": [np.array([1, 2])]})]), True),
]  # fmt: skip


@pytest.mark.parametrize(
    ("first", "second", "same"), [c[1:] for c in FINGERPRINT_CASES], ids=[c[0] for c in FINGERPRINT_CASES]
)
def test_fingerprint_follows_content(first: Callable, second: Callable, same: bool) -> None:
    model = _objects(0)[0]
    (m1, f1), (m2, f2) = first(model), second(model)
    assert (content_fingerprint({"lr": 1}, m1, *f1) == content_fingerprint({"lr": 1}, m2, *f2)) == same


def test_directory_files_are_fsynced_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(
        os,
        "fsync",
        lambda fd: (events.append(f"fsync:{os.readlink(f'/proc/self/fd/{fd}')}"), real_fsync(fd))[1],
    )
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(f"replace:{b}"), real_replace(a, b))[1])
    with io.atomic_directory(tmp_path / "out") as tmp:
        for name in ("a.bin", "b.bin"):
            (tmp / name).write_bytes(b"x" * 10)
    rename = events.index(f"replace:{tmp_path / 'out'}")
    synced = [e for e in events[:rename] if e.startswith("fsync:")]
    assert any(e.endswith("/a.bin") for e in synced) and any(e.endswith("/b.bin") for e in synced)
