"""What more conversion fine-tuning buys: own valid rate, R@1 and tokens per forward against CFT steps.

    .venv/bin/python benchmarks/cft_scaling.py --steps 600 2000 [--noise complementary suffix]
        [--device cuda] [--taus 0.9 0.4] [--save DIR]

Each step count is its own CFT run from `data/06_models/naive` with the `cft` parameters of
`conf/base/parameters_training.yml` (so its learning-rate schedule is the one a user would get by
setting `cft.train.max_steps`), on `data/05_model_input/sft_examples.parquet`. After each run the
validation requests (`--split`; choose on validation, report on test) are re-ranked as served (answer
grammar on) and the table reports the model's own valid rate (`unforced_rate`), R@1 and output tokens per forward at each tau. The default run's CFT is
sized for two CPU cores; this shows what the same recipe reaches with more compute (a GPU runs it in
minutes). `--save DIR` keeps each model as `DIR/cft<steps>` (`DIR/cft<steps>_suffix` for suffix noise) (time it with saved_models_bench.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from transformers import AutoTokenizer

from diffusion_gr2.core.evaluate.rankings import stage_metrics
from diffusion_gr2.core.model.factory import load_model, save_model
from diffusion_gr2.core.rank.rerank import RerankConfig, rerank_system, select_requests
from diffusion_gr2.core.train.loop import TrainConfig, train
from diffusion_gr2.core.train.losses import NOISE_PATTERNS
from diffusion_gr2.core.train.stages import (
    SupervisedConfig,
    example_batches,
    policy_block_size,
    supervised_loss,
)
from diffusion_gr2.parameters import file_parameters

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", required=True)
    parser.add_argument("--taus", type=float, nargs="+", default=[0.9, 0.4])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--split", default="valid", choices=["valid", "test"], help="requests re-ranked")
    parser.add_argument("--max-users", type=int, default=None, help="first N requests (default all)")
    parser.add_argument("--models", type=Path, default=ROOT / "data/06_models")
    parser.add_argument("--data", type=Path, default=ROOT / "data/05_model_input")
    parser.add_argument("--params", type=Path, default=ROOT / "conf/base/parameters_training.yml")
    parser.add_argument("--lr", type=float, default=None, help="overrides cft.train.lr")
    parser.add_argument(
        "--noise", nargs="+", default=None, choices=NOISE_PATTERNS, help="CFT canvases (default: the params')"
    )
    parser.add_argument(
        "--lambda-r",
        type=float,
        default=None,
        help="overrides cft.supervised.lambda_r (reasoning tokens' weight)",
    )
    parser.add_argument("--save", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("cft_scaling.json"))
    args = parser.parse_args()

    params = file_parameters(args.params)["cft"]
    tokenizer = AutoTokenizer.from_pretrained(args.models / "tokenizer", local_files_only=True)
    examples = pd.read_parquet(args.data / "sft_examples.parquet")
    requests = select_requests(pd.read_parquet(args.data / "requests.parquet"), args.split, args.max_users)
    decoding = RerankConfig(max_new_tokens=192, device=args.device, sid_threshold=None)  # plain tau
    results = []
    noises = args.noise or [params["supervised"].get("noise", "complementary")]
    for steps, noise in itertools.product(args.steps, noises):
        model = load_model(args.models / "naive")
        supervised = params["supervised"] | {"noise": noise}
        if args.lambda_r is not None:
            supervised["lambda_r"] = args.lambda_r
        config = SupervisedConfig(**supervised, block_size=policy_block_size(model))
        make_batch = example_batches(examples, tokenizer.pad_token_id, config)
        loss_fn = supervised_loss(config, tokenizer.mask_token_id)
        train_params = {**params["train"], "max_steps": steps, "cpu": args.device == "cpu"}
        train_params |= {"resume": False, "checkpoint_every": 0, "progress": False}
        if args.lr is not None:
            train_params["lr"] = args.lr
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            result = train(model, make_batch, loss_fn, TrainConfig(output_dir=tmp, **train_params))
        train_s = time.perf_counter() - start
        model.eval()
        if args.save is not None:
            suffix = "" if noise == "complementary" else f"_{noise}"  # the default keeps its plain name
            save_model(model, tokenizer, args.save / f"cft{steps}{suffix}")
        settings = [(tau, None) for tau in args.taus]
        rows, _ = rerank_system(model, requests, tokenizer, "cft", settings, decoding, split=args.split)
        for metrics in stage_metrics(rows, n_boot=1000):
            group = rows[rows["tau"].astype("float64") == metrics["tau"]]
            results.append(
                {
                    "cft_steps": steps,
                    "noise": noise,
                    "lr": train_params["lr"],
                    "lambda_r": supervised["lambda_r"],
                    "tau": metrics["tau"],
                    "train_seconds": round(train_s, 1),
                    "final_loss": result.final_metrics.get("loss"),
                    "unforced_rate": metrics["unforced_rate"],
                    "recall@1": metrics["recall@1"],
                    "recall@1_ci": metrics["ci"]["recall@1"],
                    "tokens_per_forward": float(group["output_tokens"].sum() / group["nfe"].sum()),
                    "n": metrics["n"],
                }
            )
            r = results[-1]
            print(
                f"steps {steps:6d} {noise:13s} tau {r['tau']:.1f}  own-valid {r['unforced_rate']:.3f}  "
                f"R@1 {r['recall@1']:.3f} [{r['recall@1_ci'][0]:.3f}, {r['recall@1_ci'][1]:.3f}]  "
                f"tok/fwd {r['tokens_per_forward']:.2f}  train {train_s:.0f} s",
                flush=True,
            )
        args.out.write_text(json.dumps(results, indent=2))  # after every run: partial results survive


if __name__ == "__main__":
    torch.set_float32_matmul_precision("highest")
    main()
