"""What the request log costs a served request (core/serving/request_log.py).

Times `log_rows` + `RequestLog.append` for calls of 1 and 32 requests with a served answer's size (a
20-item history, 10 candidates, a ~600-character explanation), one writer and four concurrent
writer processes (the lock's contention), with rotation on. Prints microseconds per request
(median and p95 over calls) and the bytes a row takes.

    .venv/bin/python benchmarks/request_log_cost.py [--calls 2000] [--folder /tmp/request_log_bench]
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import statistics
import time
from pathlib import Path

from diffusion_gr2.core.serving.request_log import (
    LOG_NAME,
    RequestLog,
    RequestLogConfig,
    ServedModel,
    encode,
    log_rows,
)

MODEL = ServedModel("diffusion-gr2", "7", "models:/diffusion-gr2@champion")


def call(batch: int) -> tuple[list[dict], list[dict]]:
    """One call's requests and answers, sized as served ones."""
    records = [
        {
            "request_id": f"r{i}",
            "user_id": f"{100 + i}",
            "history": [str(1000 + k) for k in range(20)],
            "candidates": [str(2000 + k) for k in range(10)],
        }
        for i in range(batch)
    ]
    answers = [
        {
            "request_id": f"r{i}",
            "ranking": [str(2000 + k) for k in range(10)],
            "explanation": "The user watched several dramas of the nineties; " * 12,
            "valid": True,
            "unforced": None,
            "reason": "",
            "system": "rl",
            "tau": 0.75,
            "window": None,
            "output_tokens": 96,
            "nfe": 41,
            "unknown_history": 0,
            "latency_ms": 812.5,
        }
        for i in range(batch)
    ]
    return records, answers


def timed(folder: str, calls: int, batch: int, max_bytes: int) -> list[float]:
    """Microseconds per request of each call (rows built and appended)."""
    log = RequestLog(RequestLogConfig(enabled=True, folder=folder, max_bytes=max_bytes, backups=2))
    records, answers = call(batch)
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        log.append(log_rows(records, answers, MODEL, "serve"))
        out.append((time.perf_counter() - start) * 1e6 / batch)
    return out


def _worker(args: tuple[str, int, int, int]) -> list[float]:
    return timed(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--folder", default="/tmp/request_log_bench")
    parser.add_argument(
        "--max-bytes", type=int, default=8 << 20, help="rotation size (several rotations a run)"
    )
    args = parser.parse_args()
    folder = Path(args.folder)
    shutil.rmtree(folder, ignore_errors=True)
    row_bytes = len(encode(log_rows(*call(1), MODEL, "serve")[0]))
    print(f"one row: {row_bytes} bytes; rotation at {args.max_bytes} bytes")
    for writers in (1, 4):
        for batch in (1, 32):
            shutil.rmtree(folder, ignore_errors=True)
            jobs = [(str(folder), max(args.calls // batch, 50), batch, args.max_bytes)] * writers
            with multiprocessing.get_context("fork").Pool(writers) as pool:
                per_request = [x for r in pool.map(_worker, jobs) for x in r]
            per_request.sort()
            p95 = per_request[int(0.95 * (len(per_request) - 1))]
            print(
                f"{writers} writer(s), {batch:2d} requests a call: {statistics.median(per_request):7.1f} us "
                f"per request (p95 {p95:7.1f}), {len(per_request)} calls"
            )
    assert (folder / LOG_NAME).exists()
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
