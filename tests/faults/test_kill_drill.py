"""Kill -9 drill: SIGKILL mid-checkpoint, damage the newest checkpoint, resume: same final weights.

Three processes: an uninterrupted run; a run killed while it writes checkpoint 6 (a half-written temp
folder stays behind); after step-000004 is damaged, a resumed run, which must fall back to step 2 and
end with bit-identical weights.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import safetensors.torch
import torch

from diffusion_gr2.core.train.checkpoint import checkpoint_dirs

WORKER = Path(__file__).with_name("_drill_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _worker(out: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(out), *args], env=env, stderr=subprocess.PIPE, text=True
    )


def _finish(process: subprocess.Popen) -> str:
    _, err = process.communicate(timeout=120)
    assert process.returncode == 0, err[-3000:]
    return err


def _wait_for(path: Path, process: subprocess.Popen, seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, process.stderr.read()[-3000:] if process.stderr else ""
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_sigkill_mid_checkpoint_then_damaged_newest_resumes_to_the_same_weights(tmp_path: Path) -> None:
    reference, run = tmp_path / "reference", tmp_path / "run"
    reference.mkdir(), run.mkdir()
    uninterrupted = _worker(reference)
    killed = _worker(run, "6")  # both start at once: process start-up dominates the drill
    _wait_for(run / "paused", killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=30)
    assert killed.returncode == -signal.SIGKILL
    _finish(uninterrupted)

    checkpoints = run / "checkpoints"
    assert [s for s, _ in checkpoint_dirs(checkpoints)] == [2, 4]
    partial = Path((run / "paused").read_text())
    assert partial.is_dir() and {p.name for p in partial.iterdir()} == {"model.safetensors", "optimizer.bin"}
    newest = checkpoints / "step-000004" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # damage the newest complete one

    log = _finish(_worker(run))
    assert json.loads((run / "result.json").read_text()) == {"resumed_from": 2, "steps": 8}
    assert "unusable checkpoint skipped" in log and "step-000004/model.safetensors" in log
    assert not partial.exists() and (checkpoints / "step-000004.corrupt").is_dir()
    assert [s for s, _ in checkpoint_dirs(checkpoints)] == [6, 8]

    expected = safetensors.torch.load_file(reference / "final.safetensors")
    got = safetensors.torch.load_file(run / "final.safetensors")
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected), "resumed weights differ"
    saved = safetensors.torch.load_file(checkpoints / "step-000006" / "model.safetensors")
    first = {k.removeprefix("model."): v for k, v in saved.items()}  # the loop saves its LossModule
    assert not all(
        torch.equal(first[k], got[k]) for k in got.keys() & first.keys()
    )  # training did move the weights
