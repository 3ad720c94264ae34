"""data_prep: raw interactions + metadata → validated interactions, items and split."""

from kedro.pipeline import Node, Pipeline

from .nodes import prepare_dataset, validate_splits


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                prepare_dataset,
                inputs="params:data_prep",
                outputs={
                    "interactions": "interactions",
                    "items": "items",
                    "splits": "splits",
                    "rejects": "rejects",
                    "data_stats": "data_stats",
                    "data_prep_metrics": "data_prep_metrics",
                },
                name="prepare_dataset",
            ),
            Node(
                validate_splits,
                inputs=["splits", "items", "params:data_prep"],
                outputs="splits_validation",
                name="validate_splits",
            ),
        ]
    )
