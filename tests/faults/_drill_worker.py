"""Run by test_kill_drill.py as a subprocess: a small SFT stage on the shared training loop.

A tiny Qwen3 (with attention dropout, so the resumed run also depends on the restored RNG) trains on
fixed synthetic token examples with the project's own batches and loss (`example_batches`,
`supervised_loss`). ``python _drill_worker.py OUT [PAUSE_STEP]``: with PAUSE_STEP, the process stops
inside the checkpoint write of that step, after ``model.safetensors`` and ``optimizer.bin`` are in the
temp folder, writes ``OUT/paused`` and waits to be killed. Otherwise it trains (resuming if it can)
and writes the final weights to ``OUT/final.safetensors`` and the result to ``OUT/result.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import safetensors.torch
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from diffusion_gr2.core.train.loop import TrainConfig, train
from diffusion_gr2.core.train.stages import SupervisedConfig, example_batches, supervised_loss

MAX_STEPS, EVERY = 8, 2  # checkpoints at 2, 4, 6, 8; two kept


def examples() -> pd.DataFrame:
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(12):
        prompt = rng.integers(3, 48, size=int(rng.integers(4, 8))).tolist()
        response = rng.integers(3, 48, size=int(rng.integers(3, 7))).tolist()
        rows.append((prompt, response, [0] * (len(response) - 2) + [1, 1]))
    return pd.DataFrame(rows, columns=["prompt_ids", "response_ids", "response_roles"])


def model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, attention_dropout=0.1,
        tie_word_embeddings=True, pad_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    return Qwen3ForCausalLM(config)


def pause_inside_checkpoint(out: Path, step: int) -> None:
    """Make `torch.save` stop for good once the optimizer state of checkpoint ``step`` is on disk."""
    real_save = torch.save

    def save(obj: object, f: object, *args: object, **kwargs: object) -> None:
        real_save(obj, f, *args, **kwargs)
        path = Path(str(f))
        if path.name == "optimizer.bin" and path.parent.name.startswith(f".step-{step:06d}."):
            (out / "paused").write_text(str(path.parent))
            time.sleep(600)  # the test kills us here, mid-checkpoint

    torch.save = save


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    if len(sys.argv) > 2:
        pause_inside_checkpoint(out, int(sys.argv[2]))
    net = model()
    sft = SupervisedConfig(batch_size=4, seed=3)
    config = TrainConfig(
        output_dir=str(out), lr=3e-3, max_steps=MAX_STEPS, warmup_steps=2, checkpoint_every=EVERY,
        keep_checkpoints=2, seed=11, cpu=True, progress=False,
    )  # fmt: skip
    result = train(net, example_batches(examples(), 0, sft), supervised_loss(sft), config)
    safetensors.torch.save_model(net, str(out / "final.safetensors"))
    (out / "result.json").write_text(json.dumps({"resumed_from": result.resumed_from, "steps": result.steps}))
