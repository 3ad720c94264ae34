"""Trajectory-distillation variants trained side by side from one `rl`, for decode_variants.py.

    .venv/bin/python benchmarks/distill_variants.py --out /tmp/distill \\
        --variant base --variant "cert0:supervised.certainty=0" --variant "lr1e-3:train.lr=0.001" \\
        [--models data/06_models] [--params conf/base/parameters_training.yml] [--threads 2]
    .venv/bin/python benchmarks/decode_variants.py --models /tmp/distill --systems rl base cert0 \\
        --taus 0.75 0.6 --sid-taus 0.99 --modes fused --reference ar_rl --max-users 400

Records `--init`'s (`rl`'s) served decodes on training requests once (the `distill` stage's settings, decoding as
`inference.decoding` says), then trains each variant from that model on them (`--init` a variant already trained: a second round): a variant is `name` or
`name:key=value,...` overriding the `distill` parameters by dotted key (`trajectories.*` keys re-record).
Each variant is saved to `OUT/<name>` beside links to `rl`, `ar_rl` and the tokenizer, so
decode_variants.py compares them on validation (these figures choose settings; test only reports).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import yaml
from transformers import AutoTokenizer

from diffusion_gr2.core.model.factory import load_model, save_model
from diffusion_gr2.core.rank.rerank import RerankConfig
from diffusion_gr2.core.train.loop import TrainConfig, train
from diffusion_gr2.core.train.stages import (
    SupervisedConfig,
    example_batches,
    policy_block_size,
    supervised_loss,
)
from diffusion_gr2.core.train.trajectory import TrajectoryConfig, kept_trajectories, record_trajectories
from diffusion_gr2.parameters import file_parameters

ROOT = Path(__file__).resolve().parents[1]


def _override(params: dict[str, Any], spec: str) -> tuple[str, dict[str, Any]]:
    name, _, assignments = spec.partition(":")
    params = copy.deepcopy(params)
    for assignment in filter(None, assignments.split(",")):
        key, value = assignment.split("=", 1)
        *path, last = key.split(".")
        node = params
        for part in path:
            node = node[part]
        node[last] = yaml.safe_load(value)
    return name, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", type=Path, default=ROOT / "data/06_models")
    parser.add_argument("--requests", type=Path, default=ROOT / "data/05_model_input/requests.parquet")
    parser.add_argument("--params", type=Path, default=ROOT / "conf/base/parameters_training.yml")
    parser.add_argument("--inference", type=Path, default=ROOT / "conf/base/parameters_inference.yml")
    parser.add_argument("--variant", action="append", default=[], help="name or name:key=value,...")
    parser.add_argument(
        "--init",
        default="rl",
        help="the model each variant records from and starts at (a folder of --out or --models)",
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    base = file_parameters(args.params)["distill"]
    decoding = RerankConfig(**file_parameters(args.inference)["inference"]["decoding"])
    tokenizer = AutoTokenizer.from_pretrained(args.models / "tokenizer", local_files_only=True)
    requests = pd.read_parquet(args.requests)
    train_requests = requests[requests["split"] == "train"].reset_index(drop=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("rl", "ar_rl", "tokenizer"):
        link = args.out / name
        if not link.exists():
            link.symlink_to((args.models / name).resolve())
    init = args.out / args.init if (args.out / args.init).exists() else args.models / args.init
    recorded: dict[str, pd.DataFrame] = {}
    summary = []
    for spec in args.variant or ["base"]:
        name, params = _override(base, spec)
        key = json.dumps(params["trajectories"], sort_keys=True)
        if key not in recorded:
            start = time.perf_counter()
            model = load_model(init).eval()
            recorded[key] = record_trajectories(
                model, tokenizer, train_requests, decoding, TrajectoryConfig(**params["trajectories"])
            )
            frame = recorded[key]
            print(
                f"recorded {len(frame)} in {time.perf_counter() - start:.0f} s: kept {int(frame['kept'].sum())}, "
                f"{frame['response_ids'].map(len).sum() / frame['nfe'].sum():.2f} tokens/forward, "
                f"set aside {frame.loc[~frame['kept'], 'reason'].value_counts().to_dict()}"
            )
        kept = kept_trajectories(recorded[key])
        model = load_model(init)
        config = SupervisedConfig(**params["supervised"], block_size=policy_block_size(model))
        train_config = {k: v for k, v in params["train"].items() if k in TrainConfig.__dataclass_fields__}
        train_config.update(
            output_dir=str(args.out / "runs" / name), resume=False, progress=False, checkpoint_every=0
        )
        start = time.perf_counter()
        result = train(
            model,
            example_batches(kept, tokenizer.pad_token_id, config),
            supervised_loss(config, tokenizer.mask_token_id),
            TrainConfig(**train_config),
        )
        save_model(model.eval(), None, args.out / name)
        summary.append(
            {"variant": name, "seconds": round(time.perf_counter() - start, 1), **result.final_metrics}
        )
        print(json.dumps(summary[-1]))
    (args.out / "variants.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
