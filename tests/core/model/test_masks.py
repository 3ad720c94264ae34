"""The one mask predicate: dense masks against plain-loop rules, and its three forms agree."""

from __future__ import annotations

import pytest
import torch

from diffusion_gr2.core.model.masks import (
    additive_mask,
    attention_mask,
    block_order_mask,
    cached_step_mask,
    dense_mask,
    flex_mask,
    prompt_response_layout,
    two_copy_layout,
)

K = 3


def _roles(pv: list[bool], rv: list[bool], two_copies: bool) -> list[tuple[str, int, bool]]:
    """(part, block index or column, valid) per column, written out the long way."""
    cols = [("prompt", i, v) for i, v in enumerate(pv)]
    parts = ("noisy", "clean") if two_copies else ("clean",)
    for part in parts:
        cols += [(part, j // K, v) for j, v in enumerate(rv)]
    return cols


def _allowed(q: tuple[str, int, bool], kv: tuple[str, int, bool]) -> bool:
    """docs/architecture.md#models-and-attention in words: prompt causal, never sees the response; clean copy
    block-causal + prompt; noisy block sees the prompt, strictly earlier clean blocks and itself."""
    (qp, qb, _), (kp, kb, kvalid) = q, kv
    if not kvalid:
        return False
    if qp == "prompt":
        return kp == "prompt" and kb <= qb
    if kp == "prompt":
        return True
    if qp == "clean":
        return kp == "clean" and kb <= qb
    return (kp == "clean" and kb < qb) or (kp == "noisy" and kb == qb)


def _reference(pv: torch.Tensor, rv: torch.Tensor, two_copies: bool) -> torch.Tensor:
    rows = []
    for b in range(pv.shape[0]):
        cols = _roles(pv[b].tolist(), rv[b].tolist(), two_copies)
        m = [[_allowed(q, kv) or qi == ki for ki, kv in enumerate(cols)] for qi, q in enumerate(cols)]
        rows.append(torch.tensor(m))
    return torch.stack(rows)[:, None]


def _padded() -> tuple[torch.Tensor, torch.Tensor]:
    pv = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 1, 1]], dtype=torch.bool)  # right and left padding
    rv = torch.tensor([[1] * 7, [1] * 5 + [0] * 2, [1] * 7], dtype=torch.bool)
    return pv, rv


def test_inference_mask_matches_plain_loop_rules() -> None:
    pv, rv = _padded()
    assert torch.equal(dense_mask(prompt_response_layout(pv, rv, K)), _reference(pv, rv, two_copies=False))


def test_training_mask_matches_plain_loop_rules() -> None:
    pv, rv = _padded()
    assert torch.equal(dense_mask(two_copy_layout(pv, rv, K)), _reference(pv, rv, two_copies=True))


def test_views_noisy_copies_see_only_themselves_and_share_the_clean_copy() -> None:
    pv, rv = _padded()
    p, r = pv.shape[1], rv.shape[1]
    three = dense_mask(two_copy_layout(pv, rv, K, views=2))  # [prompt | noisy 1 | noisy 2 | clean]
    two = dense_mask(two_copy_layout(pv, rv, K))  # [prompt | noisy | clean]
    keep = [*range(p + r), *range(p + 2 * r, p + 3 * r)]  # drop noisy copy 2
    assert torch.equal(three[..., keep, :][..., keep], two)
    drop_first = [*range(p), *range(p + r, p + 3 * r)]  # drop noisy copy 1
    assert torch.equal(three[..., drop_first, :][..., drop_first], two)
    assert not three[..., p : p + r, p + r : p + 2 * r].any()  # copy 1 never sees copy 2
    assert not three[..., p + r : p + 2 * r, p : p + r].any()
    with pytest.raises(ValueError, match="views"):
        two_copy_layout(pv, rv, K, views=0)


def test_block_size_one_is_causal_and_positions_skip_padding() -> None:
    pv = torch.ones(1, 3, dtype=torch.bool)
    layout = prompt_response_layout(pv, torch.ones(1, 4, dtype=torch.bool), 1)
    assert torch.equal(dense_mask(layout)[0, 0], torch.tril(torch.ones(7, 7, dtype=torch.bool)))
    left = prompt_response_layout(
        torch.tensor([[False, False, True, True]]), torch.ones(1, 2, dtype=torch.bool), 2
    )
    assert left.position.tolist() == [[0, 0, 0, 1, 2, 3]]


def test_two_copy_positions_are_shared() -> None:
    pv, rv = _padded()
    layout = two_copy_layout(pv, rv, K)
    p, r = pv.shape[1], rv.shape[1]
    assert torch.equal(layout.position[:, p : p + r], layout.position[:, p + r :])
    assert layout.position[1, p].item() == 2  # the response follows the 2 real prompt tokens


def test_additive_mask_uses_finfo_min() -> None:
    mask = torch.tensor([[True, False]])
    out = additive_mask(mask, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert out.tolist() == [[0.0, torch.finfo(torch.bfloat16).min]]
    assert (
        attention_mask(prompt_response_layout(mask, mask, 1), "eager", torch.float32).dtype == torch.float32
    )


def test_cached_step_slice_equals_predicate() -> None:
    pv = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)  # left-padded, as the decoder does
    layout = prompt_response_layout(pv, torch.ones(2, 3 * K, dtype=torch.bool), K)
    for done_blocks in range(3):
        head = layout.head(pv.shape[1] + (done_blocks + 1) * K)
        full = dense_mask(head, q_len=K)  # [b, 1, K, n]
        assert torch.equal(cached_step_mask(head.valid, "sdpa", torch.float32).expand_as(full), full)


def test_flex_block_mask_is_built_from_the_same_predicate() -> None:
    pv, rv = _padded()
    layout = two_copy_layout(pv, rv, K)
    block_mask = flex_mask(layout)
    assert tuple(block_mask.shape) == (3, 1, layout.length, layout.length)
    b, q, kv = torch.meshgrid(
        torch.arange(3), torch.arange(layout.length), torch.arange(layout.length), indexing="ij"
    )
    via_mod = block_mask.mask_mod(b, torch.zeros_like(b), q, kv)
    assert torch.equal(via_mod[:, None], dense_mask(layout))


@pytest.mark.parametrize("k", [1, 4])
def test_block_order_mask_is_the_predicate_after_the_prompt(k: int) -> None:
    """Every decode step after the prefill (a clean block beside a canvas, AR's jumped tokens, a
    canvas alone) gets from `block_order_mask` exactly the predicate's mask, padded prompts included."""
    prompt_valid = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    layout = prompt_response_layout(prompt_valid, torch.ones(2, 4 * k, dtype=torch.bool), k)
    p = prompt_valid.shape[1]
    for cached, fed in [(p, 2 * k), (p + k, 2 * k), (p + k, k), (p, 3)]:
        head = layout.head(cached + fed)
        assert torch.equal(block_order_mask(head, fed), dense_mask(head, fed)), (cached, fed)
    assert not torch.equal(
        block_order_mask(layout.head(p), p), dense_mask(layout.head(p), p)
    )  # padded prefill
