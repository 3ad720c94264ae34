"""Two CPU processes under torchrun: gradients synchronised, one writer, exact resume across processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _ddp_worker import config, make_batch, mlp, mse_loss  # noqa: E402

from diffusion_gr2.core.train.loop import train  # noqa: E402

WORKER = Path(__file__).with_name("_ddp_worker.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.slow
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed next to python")
def test_two_processes_equal_one_process_with_accumulation(tmp_path: Path) -> None:
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", str(WORKER), str(tmp_path / "ddp")]
    subprocess.run(cmd, check=True, capture_output=True, timeout=90)
    # One process with two micro-batches per step sees exactly the batches the two ranks saw.
    one = mlp(0)
    train(one, make_batch, mse_loss, config(str(tmp_path / "one"), grad_accum=2))
    r0, r1, resumed = (
        torch.load(tmp_path / "ddp" / f) for f in ("weights_0.pt", "weights_1.pt", "resumed_1.pt")
    )
    for key, value in one.state_dict().items():
        assert torch.equal(r0[key], r1[key]), key  # ranks stayed in sync
        assert torch.equal(resumed[key], r0[key]), key  # resumed two-process run is exact
        torch.testing.assert_close(r0[key], value, rtol=1e-6, atol=1e-7)
    rng_states = sorted(p.name for p in (tmp_path / "ddp/checkpoints/step-000006").glob("random_states_*"))
    assert rng_states == ["random_states_0.pkl", "random_states_1.pkl"]  # one per process
