"""Expert iteration on the AR teacher, screened side by side: its own valid free answers as SFT data.

    .venv/bin/python benchmarks/expert_iteration.py --out /tmp/ei \\
        --variant "mix10:rank=10,mix=true" --variant "own3:rank=3,mix=false" [--steps 300] [--lr 5e-4] \\
        [--models data/06_models] [--data data/05_model_input] [--threads 2]
    .venv/bin/python benchmarks/decode_variants.py --models /tmp/ei --requests data/05_model_input/requests.parquet \\
        --systems ar_rl mix10 own3 --reference ar_rl --max-users 400

The DAG's `teacher_ei` step is the mix10 variant (conf/base/parameters_training.yml); this screens
others side by side. The teacher (`--init`, `ar_rl`) decodes every training request greedily
without the grammar, once (`OUT/own.parquet`); an answer is kept when it is valid (its own, not the
grammar's) and ranks the target within `rank`. Each variant fine-tunes the teacher on the kept answers (`mix=true`: together
with the SFT examples) with the SFT loss for `--steps` steps, and is saved to `OUT/<name>` beside
links to `ar_rl` and the tokenizer, so decode_variants.py compares its own valid rate and R@1 on
validation (these figures choose settings; test only reports).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
import torch
from transformers import AutoTokenizer

from diffusion_gr2.core.model.factory import load_model, save_model
from diffusion_gr2.core.rank.rerank import RerankConfig
from diffusion_gr2.core.train.loop import TrainConfig, train
from diffusion_gr2.core.train.stages import SupervisedConfig, example_batches, supervised_loss
from diffusion_gr2.core.train.trajectory import EXAMPLE_COLUMNS, TrajectoryConfig, record_trajectories

ROOT = Path(__file__).resolve().parents[1]


def own_answers(model_dir: Path, tokenizer, requests: pd.DataFrame) -> pd.DataFrame:
    """Greedy free answers to `requests` with their validity and the target's rank (0: unranked):
    the DAG's `record_teacher_answers`, every answer recorded (variants choose their own rank)."""
    config = TrajectoryConfig(tau=None, requests=None, max_target_rank=10, seed=0, grammar=False)
    return record_trajectories(load_model(model_dir).eval(), tokenizer, requests, RerankConfig(), config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", type=Path, default=ROOT / "data/06_models")
    parser.add_argument("--data", type=Path, default=ROOT / "data/05_model_input")
    parser.add_argument("--init", default="ar_rl")
    parser.add_argument("--variant", action="append", default=[], help="name:rank=R,mix=true|false")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.models / "tokenizer", local_files_only=True)
    requests = pd.read_parquet(args.data / "requests.parquet")
    sft = pd.read_parquet(args.data / "sft_examples.parquet")[EXAMPLE_COLUMNS]
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("ar_rl", "tokenizer"):
        if not (args.out / name).exists():
            (args.out / name).symlink_to((args.models / name).resolve())
    own_path = args.out / "own.parquet"
    if not own_path.exists():
        start = time.perf_counter()
        own = own_answers(args.models / args.init, tokenizer, requests[requests["split"] == "train"])
        own.to_parquet(own_path)
        print(
            f"decoded {len(own)} in {time.perf_counter() - start:.0f} s: own valid {own['valid'].mean():.3f}"
        )
    own = pd.read_parquet(own_path)
    for spec in args.variant or ["mix10:rank=10,mix=true"]:
        name, _, settings = spec.partition(":")
        options = dict(item.split("=", 1) for item in filter(None, settings.split(",")))
        rank, mix = int(options.get("rank", 10)), options.get("mix", "true") == "true"
        kept = own[own["valid"] & own["target_rank"].between(1, rank)][EXAMPLE_COLUMNS]
        data = pd.concat([sft, kept], ignore_index=True) if mix else kept.reset_index(drop=True)
        model = load_model(args.models / args.init)
        config = SupervisedConfig(block_size=1)  # the teacher SFT's loss settings (conf/base)
        start = time.perf_counter()
        result = train(
            model,
            example_batches(data, tokenizer.pad_token_id, config),
            supervised_loss(config),
            TrainConfig(
                output_dir=str(args.out / "runs" / name),
                max_steps=args.steps,
                lr=args.lr,
                warmup_steps=10,
                resume=False,
                progress=False,
                checkpoint_every=0,
            ),
        )
        save_model(model.eval(), None, args.out / name)
        seconds = round(time.perf_counter() - start, 1)
        print(json.dumps({"variant": name, "examples": len(data), "own_kept": len(kept), "seconds": seconds}))
        print(json.dumps({k: v for k, v in result.final_metrics.items() if isinstance(v, float)}))


if __name__ == "__main__":
    main()
