"""inference: every system re-ranks the validation and test requests; diffusion systems per tau.
The pre-rank and the learned analyst (the teacher's ceiling) answer without a model.

One node per system, so `create_pipeline(systems=...)` can leave out systems whose model is not
trained yet (Kedro parameters are not available when pipelines are built). Each model system's node
runs on every process of a launch, each decoding its share of the requests (core/decode/shards.py). Diffusion systems read
the reference's (`ar_rl`) rankings to choose their operating point on validation, and its model to
time the candidates' speed-ups against it in the same rounds.
"""

from __future__ import annotations

from collections.abc import Sequence

from kedro.pipeline import Node, Pipeline

from diffusion_gr2.core.rank.rerank import AR_SYSTEMS, SYSTEMS
from diffusion_gr2.runner import ALL_RANKS

from .nodes import combine_rankings, make_rerank_node, rerank_analyst, rerank_prerank

__all__ = ["SYSTEMS", "create_pipeline"]

REFERENCE = "ar_rl"  # operating points are chosen against this system's validation R@1
# The systems no model answers (rerank.NO_MODEL_SYSTEMS), each node's function and inputs; rank 0
# runs them. The analyst's order needs each request's history (`candidates`) and the evidence.
NO_MODEL_NODES = {
    "prerank": (rerank_prerank, ["requests", "params:inference"]),
    "analyst": (
        rerank_analyst,
        ["requests", "candidates", "evidence", "splits", "items", "params:inference"],
    ),
}


def _output(system: str) -> str:
    """A system no model answers gives a rankings frame; every model system its rankings and
    operating point."""
    return f"rankings_{system}" if system in NO_MODEL_NODES else f"reranked_{system}"


def _system_node(system: str, systems: Sequence[str]) -> Node:
    if system in NO_MODEL_NODES:
        func, inputs = NO_MODEL_NODES[system]
        return Node(func, inputs, _output(system), name=f"rerank_{system}")
    inputs = [f"model_{system}", "requests", "tokenizer", "params:inference", "params:policy"]
    if system not in AR_SYSTEMS and REFERENCE in systems:  # its rankings and its model (timed beside)
        inputs += [_output(REFERENCE), f"model_{REFERENCE}"]
    # every process of a launch decodes its share of the requests (core/decode/shards.py)
    return Node(
        make_rerank_node(system),
        inputs=inputs,
        outputs=_output(system),
        name=f"rerank_{system}",
        tags=ALL_RANKS,
    )


def create_pipeline(systems: Sequence[str] = SYSTEMS, **kwargs) -> Pipeline:
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; expected a subset of {SYSTEMS}")
    ordered = [s for s in SYSTEMS if s in systems]  # report order, whatever order was asked
    combine = Node(
        combine_rankings,
        inputs=[_output(s) for s in ordered],
        outputs={
            "rankings": "rankings",
            "operating_point": "operating_point",
            "inference_metrics": "inference_metrics",
        },
        name="combine_rankings",
    )
    return Pipeline([*(_system_node(s, ordered) for s in ordered), combine])
