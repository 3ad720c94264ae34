"""Batch re-ranking at scale: requests per second and peak memory with 1 and N processes, one run.

    .venv/bin/python benchmarks/batch_rerank.py [--requests 100000] [--processes 1 2] [--threads 1]
        [--model-uri models:/diffusion-gr2@champion] [--project .] [--out DIR]

Builds a batch of `--requests` requests from the test split's users (`data/05_model_input/
candidates.parquet`, raw ids via `data/03_primary/items.parquet`; the users' test requests in turn,
each under its own request id), then answers it with `kedro run --pipelines rerank` once per process
count: one process as `python -m diffusion_gr2 run`, more under `accelerate launch --multi_gpu
--num_processes N` (gloo on CPUs, one GPU each where there are GPUs), each process at `--threads`
torch threads, the served version (`--model-uri`, the champion of `--project`'s MLflow store) at
its operating point. Each run works in a scratch project of its own (the repository's conf, a fresh
data folder), so the runs share nothing but the registry.

Reported per process count: wall time of the whole command (start-up included) and requests per
second over it, peak memory of the whole process tree (the sum of every process's resident memory,
sampled every 0.2 s) and of its largest process, and whether the answers equal the first run's
(latency aside). Figures go to `<out>/batch_rerank.json` and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import psutil

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]  # the conf every run uses
REQUESTS_DIR = Path("data/05_model_input/rerank_requests")
ANSWERS_DIR = Path("data/07_model_output/reranked")


def build_requests(project: Path, n: int, path: Path) -> int:
    """`n` requests cycling over the test split's users, as JSON Lines in raw ids; the users used."""
    candidates = pd.read_parquet(project / "data/05_model_input/candidates.parquet")
    items = pd.read_parquet(project / "data/03_primary/items.parquet")
    raw = dict(zip(items["item_id"], items["raw_item_id"].astype(str), strict=True))
    test = candidates[candidates["split"] == "test"].sort_values(["point", "user_id"], kind="stable")
    rows = [
        {"history": [raw[int(i)] for i in r.history], "candidates": [raw[int(i)] for i in r.candidates]}
        | {"user": int(r.user_id)}
        for r in test.itertuples(index=False)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as out:
        for k in range(n):
            row = rows[k % len(rows)]
            request = {
                "request_id": f"{row['user']}-{k}",
                "history": row["history"],
                "candidates": row["candidates"],
            }
            out.write(json.dumps(request) + "\n")
    return len(rows)


def scratch_project(root: Path, requests: Path) -> Path:
    """This repository's conf and pyproject in `root`, with the request file and empty outputs."""
    shutil.copytree(REPO / "conf", root / "conf", ignore=shutil.ignore_patterns("local"))
    (root / "conf" / "local").mkdir()
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    (root / "src").mkdir()
    (root / REQUESTS_DIR).mkdir(parents=True)
    shutil.copy(requests, root / REQUESTS_DIR)
    return root


def command(processes: int, model_uri: str) -> list[str]:
    kedro = ["run", "--pipelines", "rerank", "--params", f"rerank.model_uri={model_uri}"]
    if processes == 1:
        return [str(BIN / "python"), "-m", "diffusion_gr2", *kedro]
    launch = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", str(processes)]
    launch += [
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        "0",
    ]
    return [*launch, "-m", "diffusion_gr2", *kedro]


def run_measured(cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> dict[str, float]:
    """Run `cmd`; its wall time and the peak resident memory of its process tree (sum and largest)."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    root = psutil.Process(proc.pid)
    peak_sum = peak_one = 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            rss = [p.memory_info().rss for p in tree if p.is_running()]
        except psutil.Error:
            rss = []
        peak_sum, peak_one = max(peak_sum, sum(rss)), max(peak_one, max(rss, default=0))
        time.sleep(0.2)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{log.read_text()[-4000:]}")
    return {"wall_s": wall, "peak_rss_gb": peak_sum / 2**30, "peak_rss_largest_gb": peak_one / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--model-uri", default="models:/diffusion-gr2@champion")
    parser.add_argument(
        "--project", type=Path, default=Path("."), help="the default run whose data/ and mlflow.db are read"
    )
    parser.add_argument("--out", type=Path, default=Path("data/08_reporting"))
    args = parser.parse_args()
    project = args.project.resolve()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "MLFLOW_TRACKING_URI": os.environ.get("MLFLOW_TRACKING_URI", f"sqlite:///{project / 'mlflow.db'}"),
    }
    rows, first = [], None
    with tempfile.TemporaryDirectory(prefix="batch_rerank_") as tmp:
        requests = Path(tmp) / "requests.jsonl"
        users = build_requests(project, args.requests, requests)
        print(
            f"{args.requests} requests from {users} test users: {requests.stat().st_size / 2**20:.0f} MiB",
            flush=True,
        )
        for n in args.processes:
            root = scratch_project(Path(tmp) / f"p{n}", requests)
            figures = run_measured(command(n, args.model_uri), root, env, Path(tmp) / f"p{n}.log")
            answers = pd.read_parquet(root / ANSWERS_DIR).drop(columns="latency_ms")
            report = json.loads((root / "data/08_reporting/rerank_report.json").read_text())
            first = answers if first is None else first
            rows.append(
                {"processes": n, "threads_each": args.threads, "requests": len(answers)}
                | figures
                | {"requests_per_s": len(answers) / figures["wall_s"], "served": report["served"]}
                | {"valid_rate": report["valid_rate"], "equal_to_first": bool(answers.equals(first))}
            )
            print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"model_uri": args.model_uri, "cpu": _cpu(), "rows": rows}
    (args.out / "batch_rerank.json").write_text(json.dumps(result, indent=2))
    print(
        "| processes | requests | wall (s) | requests/s | peak memory, all processes (GB) | largest process (GB) | equal |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['processes']} | {r['requests']} | {r['wall_s']:.0f} | {r['requests_per_s']:.1f} | "
            f"{r['peak_rss_gb']:.2f} | {r['peak_rss_largest_gb']:.2f} | {r['equal_to_first']} |"
        )


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
