"""The README's day-to-day path at smoke sizes with `rl` refused on validation and the teacher refused
by its gate: `make register` then `make serve` end with an endpoint answering in the retriever's order,
and the output says which and why."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pandas as pd
import pytest
import yaml

from diffusion_gr2.core.rank.rerank import SERVED_DIFFUSION
from diffusion_gr2.core.registry import registry
from tests.conftest import isolated_project, run_kedro
from tests.ops.test_serving import free_port

BIN = Path(sys.executable).parent


def serve_and_ask(root: Path, request: dict) -> tuple[str, dict]:
    """`python -m diffusion_gr2 serve` in `root` (what `make serve` runs): its first line and one answer."""
    port, log = free_port(), root / "serve.log"
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "diffusion_gr2", "serve", "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                body = json.dumps({"dataframe_records": [request]}).encode()
                ask = urllib.request.Request(
                    f"http://127.0.0.1:{port}/invocations", body, {"Content-Type": "application/json"}
                )
                with urllib.request.urlopen(ask, timeout=60) as reply:
                    return log.read_text().splitlines()[0], json.loads(reply.read())
            except OSError:
                time.sleep(2)
        pytest.fail("the server did not answer in time:\n" + log.read_text()[-3000:])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.mark.slow
def test_refused_rl_and_teacher_end_serving_the_prerank(dag_run: Path, tmp_path: Path) -> None:
    with isolated_project(tmp_path / "project") as root:  # its own empty store: nothing registered yet
        shutil.copytree(dag_run / "data", root / "data", dirs_exist_ok=True)
        refusal = "own valid rate 0.40 < 0.5 at every candidate tau (forced by the test)"
        (root / "data/08_reporting/operating_point.json").write_text(
            json.dumps({SERVED_DIFFUSION: {"tau": None, "window": None, "refused": refusal}})
        )
        conf = root / "conf/smoke/parameters_policy.yml"
        params = yaml.safe_load(conf.read_text())
        params["policy"]["min_unforced_rate"] = 1.0  # no untrained teacher can pass: refused, forced
        conf.write_text(yaml.safe_dump(params))
        summary = subprocess.run(
            [sys.executable, "-m", "diffusion_gr2", "summary"], cwd=root, capture_output=True, text=True
        )
        assert summary.returncode == 0 and summary.stdout.count("\n") == 1, summary.stderr
        assert refusal in summary.stdout and "gates the teacher ar_rl alone" in summary.stdout

        run_kedro(root, ["register"])
        gate = json.loads((root / "data/08_reporting/retrain/gate.json").read_text())
        assert gate["decision"] == "not_registered" and refusal in gate["reasons"]
        assert (
            gate["teacher_gate"]["decision"] == "refuse"
            and "unforced_rate" in gate["teacher_gate"]["reasons"]
        )
        assert gate["serving"].startswith(f"serving {registry.PRERANK_MODEL} v1")

        request = pd.read_parquet(root / "data/05_model_input/gate_requests.parquet").iloc[0]
        asked = {"history": list(request["history"]), "candidates": list(request["candidates"])}
        line, reply = serve_and_ask(root, asked)
        assert line.startswith(f"serving {registry.PRERANK_MODEL} v1 (the retriever's order (pre-rank)): ")
        assert f"{registry.DIFFUSION_MODEL} has no version" in line and "gate refuse: unforced_rate" in line
        answer = reply["predictions"][0]
        assert answer["ranking"] == asked["candidates"] and answer["system"] == "prerank" and answer["valid"]
