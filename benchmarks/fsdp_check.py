"""One SFT stage on the shared loop under whatever `accelerate launch` configures (FSDP on a GPU).

    accelerate launch --config_file conf/accelerate/fsdp.yaml --num_processes 1 benchmarks/fsdp_check.py OUT

A Qwen3 of the smoke sizes (or ``--hidden/--layers`` larger) trains ``--steps`` SFT steps on synthetic
token examples with the project's own batches, loss and loop, in bf16. Then the same run is repeated
in two halves, the second resuming from the first half's checkpoint (sharded under FSDP), and must
end with the same weights. Prints the distributed type, the peak GPU memory and the check, and writes
them to ``OUT/fsdp_check.json``. Without a launcher it runs as one plain process (what the CPU can
check of it). `benchmarks/device_check.sh` runs it on the GPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from diffusion_gr2.core.train.loop import TrainConfig, train
from diffusion_gr2.core.train.stages import SupervisedConfig, example_batches, supervised_loss


def examples(vocab: int, n: int = 64) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(n):
        prompt = rng.integers(3, vocab, size=int(rng.integers(16, 48))).tolist()
        response = rng.integers(3, vocab, size=int(rng.integers(8, 24))).tolist()
        rows.append((prompt, response, [0] * (len(response) - 4) + [1] * 4))
    return pd.DataFrame(rows, columns=["prompt_ids", "response_ids", "response_roles"])


def model(args: argparse.Namespace) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
        max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0,
    )  # fmt: skip
    return Qwen3ForCausalLM(config)


def run(args: argparse.Namespace, out: Path, steps: int) -> tuple[dict[str, torch.Tensor], object]:
    net = model(args)
    sft = SupervisedConfig(batch_size=4, seed=3)
    config = TrainConfig(
        output_dir=str(out), lr=1e-3, max_steps=steps, lr_schedule="constant", checkpoint_every=args.steps // 2,
        seed=1, cpu=not torch.cuda.is_available(), mixed_precision=args.precision, progress=False,
    )  # fmt: skip
    result = train(net, example_batches(examples(args.vocab), 0, sft), supervised_loss(sft), config)
    weights = result.full_state_dict or {k: v.detach().cpu() for k, v in net.state_dict().items()}
    return weights, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--precision", default="bf16", choices=["no", "bf16"])
    args = parser.parse_args()
    shutil.rmtree(args.out / "whole", ignore_errors=True)
    shutil.rmtree(args.out / "halves", ignore_errors=True)
    whole, result = run(args, args.out / "whole", args.steps)
    run(args, args.out / "halves", args.steps // 2)  # writes the checkpoint the second half resumes from
    halves, resumed = run(args, args.out / "halves", args.steps)
    same = whole.keys() == halves.keys() and all(torch.equal(whole[k], halves[k]) for k in whole)
    from accelerate.state import PartialState

    state = PartialState()
    report = {
        "distributed_type": str(state.distributed_type),
        "processes": state.num_processes,
        "precision": args.precision,
        "steps": result.steps,
        "final_loss": result.final_metrics.get("loss"),
        "resumed_from": resumed.resumed_from,
        "resumed_weights_equal": same,
        "peak_memory_mb": round(result.peak_memory_mb, 1),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    if state.is_main_process:
        print(json.dumps(report, indent=2))
        (args.out / "fsdp_check.json").write_text(json.dumps(report, indent=2))
    if not same or resumed.resumed_from != args.steps // 2:
        raise SystemExit("resume under this launch did not reproduce the uninterrupted weights")


if __name__ == "__main__":
    main()
