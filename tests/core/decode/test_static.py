"""The static step (`static.py`): token for token the cached runner's decode, its mask the cached
runner's masks, its refusals; on CUDA, the captured graphs the same as the eager static step."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from diffusion_gr2.core.decode import static
from diffusion_gr2.core.decode.config import DecodeConfig, check
from diffusion_gr2.core.decode.decoder import DecodeOutput, decode
from diffusion_gr2.core.decode.static_cache import static_mask, step_width
from diffusion_gr2.core.model.masks import block_order_mask, dense_mask, prompt_response_layout
from tests.core.decode import golden
from tests.core.model.tiny import ATOL, DEVICE, MASK, random_prompts, tiny_model

LENGTHS = [7, 12, 3, 9, 5]  # ragged prompts: left padding differs row by row


@pytest.fixture(scope="module")
def model() -> Iterator[PreTrainedModel]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_model()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def world() -> Iterator[golden.World]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the golden dump: the same sums, so the same ties
    yield golden.world()
    torch.set_num_threads(threads)


def _same(static: list[DecodeOutput], cached: list[DecodeOutput]) -> None:
    """Tokens, commit steps, forwards, corrections and tails exactly; log-probs to ATOL."""
    for a, b in zip(static, cached, strict=True):
        assert (a.tokens, a.commit_steps, a.nfe, a.forced) == (b.tokens, b.commit_steps, b.nfe, b.forced)
        assert (a.tail_tokens, a.tail_steps) == (b.tail_tokens, b.tail_steps)
        torch.testing.assert_close(
            torch.tensor(a.token_logprobs), torch.tensor(b.token_logprobs), atol=ATOL, rtol=0
        )


def _both(model: PreTrainedModel, prompts: list[list[int]], cfg: DecodeConfig, **kw: Any) -> None:
    cached = decode(model, prompts, cfg, **kw)
    static = decode(model, prompts, dataclasses.replace(cfg, static_cache=True), **kw)
    _same(static, cached)


@pytest.mark.parametrize("batch", [1, 5])
def test_ar_static_equals_cached(model: PreTrainedModel, batch: int) -> None:
    prompts = random_prompts(LENGTHS)
    free = decode(model, prompts, DecodeConfig(max_new_tokens=16))
    eos = (free[0].tokens[3], free[1].tokens[9])  # rows end at different times
    _both(model, prompts, DecodeConfig(max_new_tokens=16, batch_size=batch, eos_token_ids=eos))


@pytest.mark.parametrize(
    ("tau", "batch", "fused", "window"),
    [(0.9, 1, True, None), (0.5, 1, True, None), (0.9, 5, True, None), (0.5, 5, True, None),
     (0.5, 5, False, None), (0.5, 5, True, 3)],
)  # fmt: skip
def test_block_static_equals_cached(
    model: PreTrainedModel, tau: float, batch: int, fused: bool, window: int | None
) -> None:
    prompts = random_prompts(LENGTHS)
    cfg = DecodeConfig(
        block_size=8, threshold=tau, max_new_tokens=22, mask_token_id=MASK, batch_size=batch, fused=fused
    )
    free = decode(model, prompts, cfg)
    eos = (free[0].tokens[5], free[1].tokens[17])
    _both(model, prompts, dataclasses.replace(cfg, eos_token_ids=eos, window=window))


@functools.cache
def _recorded() -> dict[str, Any]:
    return json.loads(Path(golden.__file__).with_name("golden_decode.json").read_text())


def _golden_case(name: str, tau: float | None) -> golden.Case:
    case = golden.cases()[name]
    return case if tau is None else dataclasses.replace(case, tau=tau)


@pytest.mark.parametrize(
    ("name", "tau"),
    [
        ("ar/plain/b6", None),  # the grammar, jump-forward on: several clean tokens a step
        ("ar/plain/b1", None),
        ("ar/free/b6", None),
        ("dm0.9/sid/plain/b6", None),  # diffusion under the grammar (jump-forward), SID gate as served
        ("dm0.9/sid/plain/b1", None),
        ("dm0.9/sid/plain/b6", 0.5),
        ("dm0.9/sid/plain/b1", 0.5),
        ("dm0.9/sid/free/b6", 0.5),
        ("dm0.75/sid/separate/window4/plain", None),  # fused=False and a window
        ("dm0.9/sid/rollout/plain", None),  # sampled: the generator draws the same numbers
        ("dm0.75/sid/copy/plain", None),  # copy drafts re-block the canvas
        ("ar+pld3/plain/b6", None),  # lossless drafts: rejected columns cropped or left as holes
        ("ar+pld1/free/b1", None),
        ("ar+dm-draft/plain/b6", None),  # a drafter model (its own cached runner)
        ("ar+twin-draft/free/b6", None),
    ],
)
def test_static_equals_cached_on_the_golden_models(world: golden.World, name: str, tau: float | None) -> None:
    """The trained golden models: confident canvases (several commits a forward), the answer
    grammar, jump-forward, drafts, ragged batches of six and rows alone."""
    case = _golden_case(name, tau)
    static = dataclasses.replace(case, extra=(*case.extra, ("static_cache", True)))
    outputs = golden.run(world, static)
    _same(outputs, golden.run(world, case))
    if tau is None and DEVICE.type == "cpu":  # and the recorded dump (recorded on the CPU)
        got = golden.record(outputs)
        assert list(golden.differences({name: got}, {name: _recorded()[name]}, atol=ATOL)) == []


def test_the_engine_outlives_a_batch_and_never_runs_stale_weights() -> None:
    """The cache (and on CUDA the graphs) serve the next `decode` call; a weight written in place
    (an RL optimiser step) makes a new one, so the static decode follows the current weights."""
    model = tiny_model(seed=3)
    prompts = random_prompts(LENGTHS)
    cfg = DecodeConfig(max_new_tokens=8, static_cache=True)
    before = decode(model, prompts, cfg)
    engine = static.engine_for(model, 5, 20, False)
    decode(model, prompts[:2], cfg)
    assert static.engine_for(model, 5, 20, False) is engine  # fits: kept
    with torch.no_grad():  # a weight the lean forward holds a stacked copy of (qkv)
        model.model.layers[0].self_attn.v_proj.weight.mul_(-3.0)
    assert not engine.fits(model, 5, 20, False)
    after = decode(model, prompts, cfg)
    assert [o.tokens for o in after] != [o.tokens for o in before]
    _same(after, decode(model, prompts, dataclasses.replace(cfg, static_cache=False)))


def test_static_mask_is_the_cached_runners_mask() -> None:
    """On the live keys the prefill's mask is the predicate's, a later step's the block order (and
    the validity row of a canvas alone); dead keys and padding are seen by no real query."""
    valid = torch.tensor([[False, False, True, True], [True, True, True, True]])
    layout = prompt_response_layout(valid, torch.ones(2, 8, dtype=torch.bool), 4)
    lay = layout.head(8)  # prompt + first block
    prefill = static_mask(lay, 0, 8, 16, own=True)
    assert torch.equal(prefill[..., :8], dense_mask(lay, 8)) and not prefill[..., 8:].any()
    step = static_mask(layout.head(12), 8, 6, 16, own=False)  # a block of 4, padded to 6
    assert torch.equal(step[:, :, :4, :12], block_order_mask(layout.head(12), 4))
    assert not step[:, :, :4, 12:].any()
    canvas = static_mask(layout.head(8), 4, 4, 16, own=False)  # block 0 alone after the prompt
    assert torch.equal(canvas[:, 0, :, :8], layout.valid[:, None, :8].expand(2, 4, 8))
    assert torch.equal(step[:, 0, 4:], torch.eye(16, dtype=torch.bool)[12:14].expand(2, 2, 16))


def test_step_widths_are_fixed_per_kind() -> None:
    assert step_width(1, 0, 1) == 1  # AR
    assert [step_width(0, q, 8) for q in (8, 3)] == [8, 8]  # canvas (a window feeds fewer)
    assert step_width(8, 8, 8) == 16  # fused
    assert [step_width(c, 0, 1) for c in (2, 3, 4, 5)] == [2, 4, 4, 8]  # jump-forward: powers of two


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"cuda_graphs": True}, "needs static_cache"),
        ({"static_cache": True, "recompute": True}, "recompute"),
        ({"static_cache": True, "backend": "eager"}, "backend 'eager'"),
    ],
)
def test_check_refuses_what_the_static_step_cannot_do(fields: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        check(DecodeConfig(**fields), 1, None, None)
    check(DecodeConfig(static_cache=True, cuda_graphs=True), 1, None, None)  # on the CPU: eager


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU (benchmarks/device_check.sh)")
@pytest.mark.parametrize("k", [1, 8])
def test_cuda_graphs_replay_the_static_step(model: PreTrainedModel, k: int) -> None:
    prompts = random_prompts(LENGTHS)
    cfg = DecodeConfig(block_size=k, threshold=0.5, max_new_tokens=22, mask_token_id=MASK, static_cache=True)
    eager = decode(model, prompts, cfg)
    _same(decode(model, prompts, dataclasses.replace(cfg, cuda_graphs=True)), eager)
