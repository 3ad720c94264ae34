"""semantic_ids: items → embeddings → RQ-VAE semantic IDs."""

from kedro.pipeline import Node, Pipeline

from .nodes import embed_item_texts, fit_item_sids


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                embed_item_texts,
                inputs=["items", "params:semantic_ids"],
                outputs=["item_embeddings", "embedding_info"],
                name="embed_item_texts",
            ),
            Node(
                fit_item_sids,
                inputs=["item_embeddings", "embedding_info", "params:semantic_ids"],
                outputs=["sids", "sid_report", "sid_metrics"],
                name="fit_item_sids",
            ),
        ]
    )
