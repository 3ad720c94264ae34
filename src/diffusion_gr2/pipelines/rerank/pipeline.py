"""rerank: batch re-ranking of request files (raw item ids) by the served model, chunk by chunk.

(The inference stage, `pipelines/inference`, re-ranks the evaluation requests with every trained
system; this pipeline serves a registered version over files users deliver.) `answer_requests` runs on every process
of a launch (each decodes its share of every chunk); rank 0 writes the chunks and the report.
"""

from kedro.pipeline import Node, Pipeline

from diffusion_gr2.runner import ALL_RANKS

from .nodes import answer_requests, summarize_answers


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                answer_requests,
                ["rerank_requests", "params:rerank", "params:serving"],
                "reranked",
                name="answer_requests",
                tags=ALL_RANKS,
            ),
            Node(
                summarize_answers,
                ["reranked", "params:rerank"],
                "rerank_report",
                name="summarize_answers",
            ),
        ]
    )
