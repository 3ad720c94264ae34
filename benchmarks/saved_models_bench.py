"""The `benchmark` pipeline's measurement on saved models, without Kedro or MLflow.

    .venv/bin/python benchmarks/saved_models_bench.py [--device cuda] [--systems ar_rl cft rl] [--out DIR]

Reads the trained systems from `data/06_models/<system>`, the requests from
`data/05_model_input/requests.parquet`, the operating points from
`data/08_reporting/operating_point.json` (written by `inference`; without it the diffusion systems
are timed only in rl's tau sweep) and every setting from `conf/base/parameters_benchmark.yml` (flags
override a few), then times them with the same core function as the Kedro node
(`core.bench.benchmark.benchmark_requests`): ar_rl, `generate` on its weights, each diffusion system at
its operating point, under the answer grammar and free. Made for machines that hold the models but not
the project's environment, such as a GPU box with only PyTorch and transformers. Writes
`benchmark.json` and `speedup_by_length.json` to `--out` and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

import pandas as pd
import torch
from transformers import AutoTokenizer

from diffusion_gr2.core.base.manifest import read_report
from diffusion_gr2.core.bench.benchmark import BenchmarkConfig, benchmark_requests, format_table
from diffusion_gr2.core.model.factory import load_model
from diffusion_gr2.core.rank.rerank import RerankConfig
from diffusion_gr2.parameters import file_parameters

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=ROOT / "data/06_models")
    parser.add_argument("--requests", type=Path, default=ROOT / "data/05_model_input/requests.parquet")
    parser.add_argument("--params", type=Path, default=ROOT / "conf/base/parameters_benchmark.yml")
    parser.add_argument(
        "--operating-point", type=Path, default=ROOT / "data/08_reporting/operating_point.json"
    )
    parser.add_argument("--systems", nargs="+", default=["ar_rl", "cft", "opd", "rl"])
    parser.add_argument("--device", default=None, help="overrides benchmark.decoding.device")
    parser.add_argument("--rounds", type=int, default=None, help="overrides benchmark.timing.rounds")
    parser.add_argument("--min-calls", type=int, default=None, help="overrides benchmark.timing.min_calls")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--graphs", type=int, nargs="*", default=None, help="overrides benchmark.timing.graphs_batch_sizes"
    )
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    params = file_parameters(args.params)["benchmark"]
    config = BenchmarkConfig.from_params(params["timing"])
    if args.rounds is not None:
        config = dataclasses.replace(config, rounds=args.rounds)
    if args.min_calls is not None:
        config = dataclasses.replace(config, min_calls=args.min_calls)
    if args.graphs is not None:
        config = dataclasses.replace(config, graphs_batch_sizes=tuple(args.graphs))
    decoding = RerankConfig(**params["decoding"])
    if args.device is not None:
        decoding = dataclasses.replace(decoding, device=args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    missing = [s for s in args.systems if not (args.models / s / "config.json").is_file()]
    if missing:
        raise SystemExit(f"{args.models}: no saved model for {missing} (run the pipeline first)")
    tokenizer = AutoTokenizer.from_pretrained(args.models / "tokenizer", local_files_only=True)
    models = {s: load_model(args.models / s) for s in args.systems}
    requests = pd.read_parquet(args.requests)
    points = None
    if args.operating_point.is_file():
        points = read_report(args.operating_point)[0]  # the figures, without the run manifest
    else:
        logging.warning(
            "%s not found: no operating points (run the inference pipeline)", args.operating_point
        )
    result = benchmark_requests(models, requests, tokenizer, decoding, config, params["split"], points)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "benchmark.json").write_text(json.dumps(result.rows, indent=2))
    (args.out / "speedup_by_length.json").write_text(json.dumps(result.length_rows, indent=2))
    print(format_table(result.rows))


if __name__ == "__main__":
    main()
