"""A rank-0 failure after its node's task (sending what the other ranks need) stops every rank of a
two-process gloo launch at once, each naming the node and rank 0's host; the wait is bounded."""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from kedro.framework.hooks.manager import _create_hook_manager
from kedro.io import DataCatalog, MemoryDataset
from kedro.pipeline import Node, Pipeline

from diffusion_gr2.runner import ALL_RANKS, WAIT_TIMEOUT_ENV, RankAwareRunner, rank0_wait


def make_lock() -> threading.Lock:
    """A rank-0 node whose output the others need but no one can copy or send (a lock)."""
    return threading.Lock()


def use_lock(lock: threading.Lock) -> str:
    return "trained"


def _rank(rank: int, port: int, out: str) -> None:
    os.environ |= {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    # were the message lost, rank 1 would wait this long and fail without the node's name
    os.environ[WAIT_TIMEOUT_ENV] = "60"
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    pipeline = Pipeline(
        [
            Node(make_lock, None, "lock", name="make_lock"),
            Node(use_lock, "lock", "trained", name="train", tags=[ALL_RANKS]),
        ]
    )
    # saved and loaded as is (no copy): it fails only where rank 0 pickles it for the other rank
    catalog = DataCatalog({"lock": MemoryDataset(copy_mode="assign"), "trained": MemoryDataset()})
    try:
        RankAwareRunner()._run(pipeline, catalog, _create_hook_manager())
        message = "no error"
    except Exception as err:  # noqa: BLE001 (what each rank stopped with is the test's subject)
        message = f"{type(err).__name__}: {err}"
    Path(out, f"rank{rank}.txt").write_text(message)
    dist.destroy_process_group()


def test_a_rank0_failure_after_its_task_stops_every_rank_naming_the_node(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_rank, args=(port, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    rank0, rank1 = ((tmp_path / f"rank{r}.txt").read_text() for r in (0, 1))
    assert "cannot pickle" in rank0  # sending the lock to the other rank failed there
    host = socket.gethostname()
    assert rank1.startswith(f"RuntimeError: rank 1 stops: rank 0 ({host}) failed after node make_lock: ")


def test_the_ranks_wait_for_rank0_no_longer_than_the_collective_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(WAIT_TIMEOUT_ENV, raising=False)
    assert rank0_wait() == timedelta(minutes=30)
    monkeypatch.setenv("DIFFUSION_GR2_COLLECTIVE_TIMEOUT_S", "120")
    assert rank0_wait() == timedelta(seconds=120)
    monkeypatch.setenv(WAIT_TIMEOUT_ENV, "7200")  # a slow rank-0 stage: raised on purpose
    assert rank0_wait() == timedelta(hours=2)
