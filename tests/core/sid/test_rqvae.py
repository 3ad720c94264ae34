"""RQ-VAE semantic IDs: uniqueness, determinism, EMA codebook behaviour, SID strings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffusion_gr2.core.sid.rqvae import (
    EMACodebook,
    RQVAEConfig,
    collision_level,
    fit_semantic_ids,
    sid_string,
    sid_token_list,
    sids_frame,
)

TINY = RQVAEConfig(codebook_size=8, hidden_dim=32, latent_dim=8, epochs=15, batch_size=64, seed=3)
REPORT_KEYS = {"levels", "codebook_sizes", "uniqueness_3", "uniqueness_4", "collisions_3", "embedding_model"}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _vectors(n: int = 160, d: int = 24, duplicates: int = 5) -> np.ndarray:
    """Clustered unit vectors; the last `duplicates` rows are identical, so they must collide."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(6, d))
    x = centres[rng.integers(0, 6, n)] + 0.3 * rng.normal(size=(n, d))
    x[-duplicates:] = x[-1]
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_four_levels_make_every_item_unique() -> None:
    x = _vectors()
    sids = fit_semantic_ids(x, TINY, embedding_model="test-model")
    codes, report = sids.codes, sids.report
    assert codes.shape == (len(x), 4) and codes.dtype == np.int64
    assert set(report) == REPORT_KEYS and report["levels"] == 4
    assert report["uniqueness_4"] == 1.0 and len({tuple(r) for r in codes}) == len(x)
    distinct3 = len({tuple(r) for r in codes[:, :3]})
    assert report["uniqueness_3"] == distinct3 / len(x) and report["collisions_3"] == len(x) - distinct3
    assert report["collisions_3"] >= 4  # the 5 identical vectors share their learned codes
    assert (codes[-5:, :3] == codes[-1, :3]).all() and len(set(codes[-5:, 3])) == 5
    assert report["codebook_sizes"][:3] == [8, 8, 8] and report["codebook_sizes"][3] == codes[:, 3].max() + 1
    assert (codes[:, :3] < 8).all() and report["embedding_model"] == "test-model"


def test_training_is_deterministic_under_a_seed_and_leaves_global_rng_alone() -> None:
    x = _vectors()
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = fit_semantic_ids(x, TINY).codes
    assert torch.equal(torch.rand(3), expected_next)  # the caller's RNG stream is untouched
    np.testing.assert_array_equal(first, fit_semantic_ids(x, TINY).codes)
    other = fit_semantic_ids(x, RQVAEConfig(**{**TINY.__dict__, "seed": 4})).codes
    assert not np.array_equal(first, other)


def test_learned_codes_give_high_uniqueness_on_spread_out_items() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 24)).astype(np.float32)
    config = RQVAEConfig(codebook_size=16, hidden_dim=64, latent_dim=8, epochs=30, batch_size=64)
    assert fit_semantic_ids(x, config).report["uniqueness_3"] > 0.9  # 16^3 cells for 200 items


def test_ema_update_moves_codes_towards_assigned_vectors_only_in_training() -> None:
    torch.manual_seed(0)
    book = EMACodebook(size=4, dim=2, decay=0.8, dead_threshold=0.0)
    book.train()
    book(torch.randn(64, 2))  # first call seeds the codebook from the batch
    shifted = torch.randn(64, 2) + torch.tensor([5.0, -5.0])
    before = book.embed.clone()
    for _ in range(30):
        book(shifted)
    moved = (book.embed - before).norm(dim=1)
    assert moved.max() > 3.0
    # The code that takes the shifted cloud converges to the cloud's mean (EMA of assigned vectors)
    assert torch.allclose(book.embed[moved.argmax()], shifted.mean(0), atol=0.05)
    book.eval()
    frozen = book.embed.clone()
    book(torch.randn(64, 2))
    assert torch.equal(book.embed, frozen)


def test_dead_codes_are_reseeded_from_the_batch() -> None:
    torch.manual_seed(0)
    book = EMACodebook(size=4, dim=2, decay=0.5, dead_threshold=0.5)
    book.train()
    data = torch.randn(32, 2)
    book(data)
    book.embed[0] = torch.tensor([100.0, 100.0])  # a code no vector will ever choose
    book.embed_sum[0] = book.embed[0] * book.cluster_size[0]
    for _ in range(10):
        book(data)
    assert book.embed[0].norm() < 10.0  # moved back among the data


def test_collision_level_numbers_each_group_in_a_seeded_order() -> None:
    codes3 = np.array([[0, 0, 0], [1, 2, 3], [0, 0, 0], [0, 0, 0], [1, 2, 3], [4, 4, 4]])
    level = collision_level(codes3, seed=0)
    assert sorted(level[[0, 2, 3]]) == [0, 1, 2] and sorted(level[[1, 4]]) == [0, 1] and level[5] == 0
    np.testing.assert_array_equal(level, collision_level(codes3, seed=0))
    orders = {tuple(collision_level(codes3, seed=s)[[0, 2, 3]]) for s in range(20)}
    assert len(orders) > 1  # the order inside a group comes from the seed, not from item ids


def test_sid_strings_and_token_list() -> None:
    assert sid_string([12, 7, 201, 3]) == "<a_12><b_7><c_201><d_3>"
    tokens = sid_token_list([3, 2, 2, 1])
    assert tokens == ["<a_0>", "<a_1>", "<a_2>", "<b_0>", "<b_1>", "<c_0>", "<c_1>", "<d_0>"]
    frame = sids_frame(np.array([[1, 0, 1, 0], [2, 1, 0, 0]]))
    assert list(frame.columns) == ["item_id", "codes", "sid"]
    assert frame["sid"].tolist() == ["<a_1><b_0><c_1><d_0>", "<a_2><b_1><c_0><d_0>"]
    assert all(t in tokens for s in frame["sid"] for t in s.replace("><", ">|<").split("|"))
