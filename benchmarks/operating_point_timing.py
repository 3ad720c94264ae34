"""Is the operating point's speed ranking stable? Repeat its timing on a run's models.

    .venv/bin/python benchmarks/operating_point_timing.py [--repeats 3] [--system rl] [--json OUT.json]

Each repeat is what the operating point's search (`core/rank/point_search.py`) does to rank the
candidates (`inference.operating_point`: its `taus` x `windows`, timed by `timing` with
`core/bench/benchmark.py::time_candidates`, the one harness, on the first validation prompts, under
the grammar, with `ar_rl` in the same rounds): output tokens/s per batch size and per round their
geometric mean, the median over rounds, and the speed-up against `ar_rl` with its interval (paired
by round; the statistic is printed). Prints each repeat's figures, the candidate it would serve and
what the timing cost. Accuracy is not re-checked here: which candidates qualify is in the run's
`operating_point.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
import torch
from transformers import AutoTokenizer

from diffusion_gr2.core.bench.benchmark import candidate_timer
from diffusion_gr2.core.evaluate.policy import Policy
from diffusion_gr2.core.model.factory import load_model
from diffusion_gr2.core.rank.operating_point import ranked_speed
from diffusion_gr2.core.rank.point_search import OperatingPointConfig
from diffusion_gr2.core.rank.rerank import RerankConfig, request_grammars, select_requests
from diffusion_gr2.parameters import file_parameters

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=ROOT / "data/06_models")
    parser.add_argument("--requests", type=Path, default=ROOT / "data/05_model_input/requests.parquet")
    parser.add_argument("--params", type=Path, default=ROOT / "conf/base/parameters_inference.yml")
    parser.add_argument("--system", default="rl")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = file_parameters(args.params)["inference"]
    # the policy of the same environment (its bars do not enter the timing; the config holds them)
    policy = Policy.from_params(file_parameters(args.params.with_name("parameters_policy.yml"))["policy"])
    point = OperatingPointConfig.from_params(params["operating_point"], policy)
    bench = point.timing
    time_candidates = candidate_timer(point)  # the harness the inference node hands the search
    tokenizer = AutoTokenizer.from_pretrained(args.models / "tokenizer", local_files_only=True)
    valid = select_requests(pd.read_parquet(args.requests), "valid", bench.n_prompts)
    prompts = [list(p) for p in valid["prompt_ids"]]
    model = load_model(args.models / args.system).eval()
    reference = load_model(args.models / point.reference).eval()  # timed beside, as the node does
    config = RerankConfig(**params["decoding"])
    grammars = request_grammars(tokenizer, valid) if config.constrained else None
    candidates = point.candidates
    repeats = []
    for r in range(args.repeats):
        start = time.perf_counter()
        timed = time_candidates(
            model,
            args.system,
            candidates,
            prompts,
            tokenizer,
            config,
            grammars=grammars,
            reference_model=reference,
        )
        seconds = time.perf_counter() - start
        rows = [
            {"tau": t, "window": w} | ranked_speed(timed[(t, w)], timed[None], point.reference)
            for t, w in candidates
        ]
        best = max(rows, key=lambda row: row["tokens_per_s"])
        repeats.append({"seconds": seconds, "candidates": rows, "fastest": [best["tau"], best["window"]]})
        name = f"speedup_vs_{point.reference}"
        cells = "; ".join(
            f"tau {row['tau']} window {row['window'] or '-'}: "
            + " ".join(f"b{b} {v:.0f}" for b, v in row["tokens_per_s_by_batch"].items())
            + f" -> {row['tokens_per_s']:.0f}, {row[name]:.2f}x [{row[name + '_low']:.2f}, {row[name + '_high']:.2f}]"
            for row in rows
        )
        print(
            f"repeat {r}: {seconds:.1f} s ({rows[0]['statistic']}); {cells}; "
            f"fastest tau {best['tau']} window {best['window'] or '-'}"
        )
    if args.json:
        args.json.write_text(json.dumps(repeats, indent=2))


if __name__ == "__main__":
    main()
