"""How the distributed tests start `accelerate launch -m diffusion_gr2 run` in a project copy."""

from __future__ import annotations

import os
import sys
from pathlib import Path

BIN = Path(sys.executable).parent
# plain lines with the process id: the ranks' logs interleave in one stream
LOGGING = """\
version: 1
disable_existing_loggers: false
formatters:
  plain: {format: "pid=%(process)d %(name)s %(message)s"}
handlers:
  console: {class: logging.StreamHandler, formatter: plain, stream: "ext://sys.stdout"}
root: {level: INFO, handlers: [console]}
"""


def launch_env(project: Path, collective_timeout_s: int = 60) -> dict[str, str]:
    """The environment of a run in `project`: its own MLflow store, plain logs, one thread a process."""
    logging_file = project / "logging.yml"
    logging_file.write_text(LOGGING)
    return {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}",
        "KEDRO_LOGGING_CONFIG": str(logging_file),
        "OMP_NUM_THREADS": "1",
        "DIFFUSION_GR2_COLLECTIVE_TIMEOUT_S": str(collective_timeout_s),
    }


def accelerate_launch(*run_args: str) -> list[str]:
    """`python -m diffusion_gr2 run <run_args>` on two processes. --multi_gpu selects accelerate's
    torch-elastic launcher; with no GPU each process runs on the CPU and the process group is gloo."""
    return [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
            "-m", "diffusion_gr2", "run", *run_args]  # fmt: skip
