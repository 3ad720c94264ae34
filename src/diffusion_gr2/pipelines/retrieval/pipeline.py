"""retrieval: split → SASRec retriever (vs popularity) → validated candidate lists."""

from kedro.pipeline import Node, Pipeline

from .nodes import retrieve_candidates, validate_candidate_lists


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                retrieve_candidates,
                ["splits", "items", "params:retrieval"],
                ["candidates", "retrieval_report", "retrieval_metrics"],
                name="retrieve_candidates",
            ),
            Node(
                validate_candidate_lists,
                ["candidates", "items", "params:retrieval", "params:data_prep.dedup"],
                "candidates_validation",
                name="validate_candidate_lists",
            ),
        ]
    )
