"""inference: every system (and every tau of a diffusion system) re-ranks the test requests.

One node per system, so `create_pipeline(systems=...)` can leave out systems whose model is not
trained yet (Kedro parameters are not available when pipelines are built).
"""

from __future__ import annotations

from collections.abc import Sequence

from kedro.pipeline import Node, Pipeline

from diffusion_gr2.core.rank.rerank import SYSTEMS

from .nodes import combine_rankings, make_rerank_node, rerank_prerank

__all__ = ["SYSTEMS", "create_pipeline"]


def _system_node(system: str) -> Node:
    if system == "prerank":
        return Node(
            rerank_prerank, ["requests", "params:inference"], "rankings_prerank", name="rerank_prerank"
        )
    return Node(
        make_rerank_node(system),
        inputs=[f"model_{system}", "requests", "tokenizer", "params:inference"],
        outputs=f"rankings_{system}",
        name=f"rerank_{system}",
    )


def create_pipeline(systems: Sequence[str] = SYSTEMS, **kwargs) -> Pipeline:
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; expected a subset of {SYSTEMS}")
    ordered = [s for s in SYSTEMS if s in systems]  # report order, whatever order was asked
    combine = Node(
        combine_rankings,
        inputs=[f"rankings_{s}" for s in ordered],
        outputs={"rankings": "rankings", "inference_metrics": "inference_metrics"},
        name="combine_rankings",
    )
    return Pipeline([*(_system_node(s) for s in ordered), combine])
