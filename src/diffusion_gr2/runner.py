"""Kedro on several processes: the training nodes on every rank, everything else once, on rank 0.

``accelerate launch -m diffusion_gr2 run ...`` starts one process per GPU; each opens its own
``KedroSession`` and runs the pipeline with :class:`RankAwareRunner`. What runs where:

* nodes tagged ``all_ranks`` (the training stages, the cheap deterministic nodes that build their
  starting model, and the decoding nodes, which share their requests out: ``core/decode/shards.py``)
  run on every rank. Rank 0 runs them as Kedro always does (inputs loaded, outputs
  saved, hooks called); the other ranks load the inputs, run the node and keep its outputs in their
  own memory for the next ``all_ranks`` node. They never save anything.
* every other node (data preparation, retrieval, traces, conversion, inference, evaluation,
  registration) runs on rank 0 only. The other ranks wait for it, then read its outputs from the
  catalog (files rank 0 has written) when an ``all_ranks`` node needs them; an in-memory output is
  sent to them instead. An output that is computed as rank 0 saves it (a batch re-rank job, which
  has a ``drain`` method) is drained on the other ranks: they compute their share and keep nothing.
  Once no ``all_ranks`` node is left, they are done. A launch runs what the shared nodes need first
  and what only rank 0 does with their outputs (reports, registration) after the last of them
  (:func:`launch_order`), so no GPU idles while rank 0 writes reports.

So every dataset save, model folder, MLflow run, artifact, lineage record and registry call happens on
rank 0 (kedro-mlflow's hooks are not even registered on the other ranks: ``settings.py``). A failure
on rank 0 outside training (in a node's task, or after it: loading or sending the outputs the others
need) is sent to the ranks waiting for it, which fail naming the node and rank 0's host. They wait for
rank 0 at most ``DIFFUSION_GR2_RANK0_WAIT_S`` (default: the collective timeout,
``DIFFUSION_GR2_COLLECTIVE_TIMEOUT_S``, 30 min; raise it when rank 0's data preparation or evaluation
takes longer); a rank that dies
during training breaks the collectives of the others, and the launcher (torch elastic) stops them all
and names the rank and host that failed first.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any

from kedro.pipeline import Pipeline
from kedro.pipeline.node import Node
from kedro.runner import SequentialRunner

logger = logging.getLogger(__name__)

ALL_RANKS = "all_ranks"  # the node tag: run on every process of a launch
WAIT_TIMEOUT_ENV = "DIFFUSION_GR2_RANK0_WAIT_S"  # how long the other ranks wait for rank 0's nodes


def rank0_wait() -> timedelta:
    """How long the other ranks wait for rank 0's nodes: ``DIFFUSION_GR2_RANK0_WAIT_S``, by default the
    collective timeout (a rank 0 that hangs fails the launch as soon as a hung collective would)."""
    from diffusion_gr2.core.train.loop import collective_timeout

    value = os.environ.get(WAIT_TIMEOUT_ENV)
    return collective_timeout() if value is None else timedelta(seconds=float(value))


def launch_rank() -> int:
    """This process's global rank (0 outside a launch)."""
    return int(os.environ.get("RANK", "0"))


def launch_size() -> int:
    """Processes of this launch (1 outside one)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def runs_on_all_ranks(node: Node) -> bool:
    return ALL_RANKS in node.tags


def launch_order(pipeline: Pipeline) -> list[Node]:
    """The nodes in the order a launch runs them, each part in Kedro's order: first everything but what
    only uses the shared nodes' outputs, then that. Rank 0's reports (``compare_to_baselines``) then
    wait until every shared node (training, decoding) is over instead of holding the other GPUs idle
    between two of them, while checks that can stop the run (the data validations) still come before
    any training."""
    shared = [n.name for n in pipeline.nodes if runs_on_all_ranks(n)]
    if not shared:
        return list(pipeline.nodes)
    later = set(pipeline.from_nodes(*shared).nodes) - set(pipeline.to_nodes(*shared).nodes)
    return [n for n in pipeline.nodes if n not in later] + [n for n in pipeline.nodes if n in later]


def placement(pipeline: Pipeline) -> list[tuple[str, str]]:
    """(node, where it runs) for every node of ``pipeline`` in launch order: docs/distributed.md's table."""
    return [(n.name, "every rank" if runs_on_all_ranks(n) else "rank 0") for n in launch_order(pipeline)]


def _ephemeral(catalog: Any, name: str) -> bool:
    """Whether dataset ``name`` lives in memory only (another process cannot read it from disk)."""
    if name.startswith("params:") or name == "parameters":
        return False  # every process loads the same configuration
    dataset = catalog.get(name, fallback_to_runtime_pattern=True)
    return dataset is None or bool(getattr(dataset, "_EPHEMERAL", False))


class RankAwareRunner(SequentialRunner):
    """A ``SequentialRunner`` that knows it is one of several processes (see the module docstring).

    In a single process it is exactly the ``SequentialRunner``.
    """

    def _run(
        self, pipeline: Pipeline, catalog: Any, hook_manager: Any = None, run_id: str | None = None
    ) -> None:
        if launch_size() == 1:
            return super()._run(pipeline, catalog, hook_manager, run_id)
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                f"WORLD_SIZE={launch_size()} but no process group: launch with "
                "`accelerate launch -m diffusion_gr2 run ...` (docs/distributed.md)"
            )
        # Waits for rank 0's nodes go through a CPU group of their own, with their own limit (`rank0_wait`)
        group = dist.new_group(backend="gloo", timeout=rank0_wait())
        nodes = launch_order(pipeline)
        last_shared = max((i for i, n in enumerate(nodes) if runs_on_all_ranks(n)), default=-1)
        needed = {name for n in nodes if runs_on_all_ranks(n) for name in n.inputs}
        if launch_rank() == 0:
            self._run_rank0(pipeline, nodes, last_shared, needed, catalog, hook_manager, run_id, group)
        else:
            self._run_other(nodes, last_shared, catalog, group)
        return None

    def _run_rank0(
        self,
        pipeline: Pipeline,
        nodes: list[Node],
        last_shared: int,
        needed: set[str],
        catalog: Any,
        hook_manager: Any,
        run_id: str | None,
        group: Any,
    ) -> None:
        from collections import Counter

        from kedro.runner.task import Task

        load_counts = Counter(name for n in nodes for name in n.inputs)  # what Kedro frees as it goes
        for index, node in enumerate(nodes):
            waited = not runs_on_all_ranks(node) and index < last_shared  # the other ranks wait for it
            step = "in node"
            try:
                Task(
                    node=node, catalog=catalog, hook_manager=hook_manager, is_async=False, run_id=run_id
                ).execute()
                self._logger.info("Completed node: %s", node.name)
                if waited:
                    step = "after node"  # its task is done: loading or sending what the others need
                    memory = {
                        name: catalog.load(name)
                        for name in node.outputs
                        if name in needed and _ephemeral(catalog, name)
                    }
                    # pickled before anything is broadcast: a failure here leaves the others waiting
                    # for a message, which the handler sends
                    _send(group, {"error": None, "outputs": memory})
                    waited = False  # sent: nobody waits any longer
            except Exception as err:
                if waited:
                    host = socket.gethostname()
                    _send(group, {"error": f"rank 0 ({host}) failed {step} {node.name}: {err!r}"})
                raise
            self._release_datasets(node, catalog, load_counts, pipeline)

    def _run_other(self, nodes: list[Node], last_shared: int, catalog: Any, group: Any) -> None:
        local: dict[str, Any] = {}  # outputs this rank holds itself (never saved)
        for index, node in enumerate(nodes[: last_shared + 1]):
            if not runs_on_all_ranks(node):
                message = _receive(group)
                if message["error"]:
                    raise RuntimeError(f"rank {launch_rank()} stops: {message['error']}")
                local.update(message["outputs"])
                continue
            inputs = {name: local[name] if name in local else catalog.load(name) for name in node.inputs}
            outputs = node.run(inputs)
            for value in outputs.values():
                if hasattr(value, "drain"):  # computed as it is saved (a batch job): this rank's share
                    value.drain()
            local.update(outputs)
            later = {name for n in nodes[index + 1 : last_shared + 1] for name in n.inputs}
            local = {name: value for name, value in local.items() if name in later}  # free the models
            self._logger.info("rank %d: completed node %s", launch_rank(), node.name)
        self._logger.info("rank %d: no node left for this rank; rank 0 finishes the run", launch_rank())


def _send(group: Any, message: dict[str, Any]) -> None:
    import torch.distributed as dist

    dist.broadcast_object_list([message], src=0, group=group)


def _receive(group: Any) -> dict[str, Any]:
    import torch.distributed as dist

    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
