"""rerank: request files (raw item ids) → the served model → rankings, in batch."""

from kedro.pipeline import Node, Pipeline

from .nodes import rerank_files


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                rerank_files,
                ["rerank_requests", "params:rerank", "params:serving"],
                {"reranked": "reranked", "rerank_report": "rerank_report"},
                name="rerank_files",
            )
        ]
    )
