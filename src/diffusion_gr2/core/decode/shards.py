"""Decoding shared by the processes of a launch: each decodes its own batches, every one gets all outputs.

`decode` (the one batching layer) forms its batches the same way whatever the number of processes
(longest prompts first, `batch_size` at a time). Inside `shared_decoding(shards)` batch ``b`` is
decoded by process ``b % size`` alone, and the outputs are then gathered so that every process
returns the same list, in prompt order. A request's owner is fixed by its batch, and each row is
decoded in the very batch a single process would decode it in, so the answers equal a one-process
run's token for token (`tests/distributed/test_batch_rerank.py`).

Sharing is opt-in: only code that every process runs in step may enter it (the batch re-rank and
the inference nodes). A rank-0-only caller (recording trajectories, the benchmark's timing) decodes
alone, outside it; `solo` leaves it for a block of such code.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["Shards", "active_shards", "launch_shards", "shared_decoding", "solo"]


@dataclass(frozen=True)
class Shards:
    """This process's place in a launch, and how objects are exchanged between the processes."""

    rank: int
    size: int
    # every process's object in rank order (all processes call it together)
    gather: Callable[[Any], list[Any]]
    # rank 0's object on every process (all processes call it together)
    broadcast: Callable[[Any], Any]

    def owns(self, batch: int) -> bool:
        return batch % self.size == self.rank

    @property
    def leads(self) -> bool:
        """Whether this process writes what the launch writes (rank 0)."""
        return self.rank == 0


_ACTIVE: ContextVar[Shards | None] = ContextVar("decode_shards", default=None)


def active_shards() -> Shards | None:
    """The shards `decode` shares its batches over now (None: this process decodes everything)."""
    return _ACTIVE.get()


@contextmanager
def shared_decoding(shards: Shards | None) -> Iterator[Shards | None]:
    """Decode shared over `shards` inside the block (None, or a launch of one: alone)."""
    token = _ACTIVE.set(shards if shards is not None and shards.size > 1 else None)
    try:
        yield _ACTIVE.get()
    finally:
        _ACTIVE.reset(token)


def solo(shards: Shards | None, work: Callable[[], T]) -> T:
    """`work()` run by rank 0 alone, outside the shared decoding, its result sent to every process
    (timings: a latency is one process's, and every process must choose the same from it)."""
    if shards is None:
        return work()
    with shared_decoding(None):
        result = work() if shards.leads else None
    return shards.broadcast(result)


def _objects(group: Any) -> tuple[Callable[[Any], list[Any]], Callable[[Any], Any]]:
    import torch.distributed as dist

    def gather(obj: Any) -> list[Any]:
        box: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(box, obj, group=group)
        return box

    def broadcast(obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    return gather, broadcast


@functools.cache
def _launch_group() -> Any:
    import torch.distributed as dist

    # Objects travel over a CPU (gloo) group whatever the training backend: NCCL would need them on a GPU.
    return dist.new_group(backend="gloo")


def launch_shards() -> Shards | None:
    """This launch's shards (`accelerate launch`, torch elastic), or None in a single process.

    Every process of the launch must call it at the same point (the first call makes a process group).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} but no process group: launch with "
            "`accelerate launch -m diffusion_gr2 run ...`"
        )
    gather, broadcast = _objects(_launch_group())
    return Shards(dist.get_rank(), dist.get_world_size(), gather, broadcast)
