"""semantic_ids nodes: item text → sentence embeddings → RQ-VAE → 4-token semantic IDs
(docs/architecture.md#items-candidates-and-prompts)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from diffusion_gr2.core.runs.mlflow_utils import as_metrics_history
from diffusion_gr2.core.sid.embeddings import embed_items, item_text
from diffusion_gr2.core.sid.rqvae import RQVAEConfig, fit_semantic_ids, sids_frame


def embed_item_texts(items: pd.DataFrame, params: dict[str, Any]) -> tuple[pd.DataFrame, dict[str, Any]]:
    """One L2-normalised vector per item, with the encoder's name and weights hash."""
    embeddings = embed_items(item_text(items), prefer=params["embedding_model"], seed=params["seed"])
    frame = pd.DataFrame({"item_id": items["item_id"].to_numpy(), "vector": list(embeddings.vectors)})
    info = {"embedding_model": embeddings.model_name, "embedding_sha256": embeddings.model_sha256}
    return frame, info


def fit_item_sids(
    item_embeddings: pd.DataFrame, embedding_info: dict[str, Any], params: dict[str, Any]
) -> tuple[pd.DataFrame, dict[str, Any], dict[str, Any]]:
    """Train the RQ-VAE and give every item a unique 4-token semantic ID."""
    ordered = item_embeddings.sort_values("item_id")
    vectors = np.stack(ordered["vector"].to_numpy())
    config = RQVAEConfig(**params["rqvae"])
    sids = fit_semantic_ids(vectors, config, embedding_model=embedding_info["embedding_model"])
    report = {**sids.report, "embedding_sha256": embedding_info["embedding_sha256"]}
    return sids_frame(sids.codes), report, as_metrics_history(report)
