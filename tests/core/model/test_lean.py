"""The lean forward (`backend: lean`) against the transformers modules it replaces."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3ForCausalLM

from diffusion_gr2.core.decode.kv_cache import buffer_cache
from diffusion_gr2.core.model.diffusion import cached_block_hidden
from diffusion_gr2.core.model.lean import LeanForward, lean_unsupported
from diffusion_gr2.core.model.masks import Layout, prompt_response_layout
from tests.core.model.tiny import ATOL, DEVICE, MASK, random_prompts, tiny_config, tiny_model

LENGTHS = [9, 4, 7]


def _padded_layout(k: int = 4, blocks: int = 2) -> tuple[torch.Tensor, torch.Tensor, Layout]:
    """Left-padded prompts of different lengths and a response of `blocks` blocks of `k` masks."""
    prompts = random_prompts(LENGTHS)
    width = max(LENGTHS)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    valid = torch.zeros(ids.shape, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        valid[row, width - len(prompt) :] = True
    response = torch.full((len(prompts), blocks * k), MASK, dtype=torch.long, device=DEVICE)
    layout = prompt_response_layout(
        valid.to(DEVICE), torch.ones(response.shape, dtype=torch.bool, device=DEVICE), k
    )
    return ids.to(DEVICE), response, layout


@torch.no_grad()
def _prompt_then_canvas(
    model: Qwen3ForCausalLM, lean: LeanForward | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states of a padded prompt (causal mask) and then of a mask canvas run after it."""
    ids, response, layout = _padded_layout()
    n, k = ids.shape[1], 4
    cache = buffer_cache(model, layout.length)
    prompt = cached_block_hidden(model, ids, layout.head(n), cache, full_mask=True, lean=lean)
    canvas = cached_block_hidden(model, response[:, :k], layout.head(n + k), cache, lean=lean)
    valid = layout.valid[:, :n]
    return prompt[valid], canvas


@pytest.mark.parametrize("head_scale", [1.0, 5.0])
def test_lean_hidden_states_equal_the_transformers_forward(head_scale: float) -> None:
    model = tiny_model(head_scale=head_scale)
    ref_prompt, ref_canvas = _prompt_then_canvas(model, None)
    prompt, canvas = _prompt_then_canvas(model, LeanForward(model))
    torch.testing.assert_close(prompt, ref_prompt, atol=ATOL, rtol=0)
    torch.testing.assert_close(canvas, ref_canvas, atol=ATOL, rtol=0)


def test_lean_reads_the_current_weights() -> None:
    """RL rollouts decode with the policy being trained: a changed weight must change the output."""
    model = tiny_model()
    before = _prompt_then_canvas(model, LeanForward(model))[1]
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(2.0)
    after_ref = _prompt_then_canvas(model, None)[1]
    after = _prompt_then_canvas(model, LeanForward(model))[1]
    torch.testing.assert_close(after, after_ref, atol=ATOL, rtol=0)
    assert not torch.allclose(before, after, atol=1e-3)


def test_lean_half_precision_follows_the_modules() -> None:
    model = tiny_model().to(torch.bfloat16)
    ref_prompt, ref_canvas = _prompt_then_canvas(model, None)
    prompt, canvas = _prompt_then_canvas(model, LeanForward(model))
    assert prompt.dtype == canvas.dtype == torch.bfloat16
    torch.testing.assert_close(prompt, ref_prompt, atol=0.05, rtol=0.02)
    torch.testing.assert_close(canvas, ref_canvas, atol=0.05, rtol=0.02)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "rope_type"),
    ],
)
def test_models_lean_cannot_run_exactly_are_refused(change: dict, reason: str) -> None:
    config = tiny_config()
    for key, value in change.items():
        setattr(config, key, value)
    model = Qwen3ForCausalLM(config)
    assert reason in (lean_unsupported(model) or "")
    with pytest.raises(ValueError, match=rf"{reason}.*backend 'eager'"):
        LeanForward(model)
    assert lean_unsupported(tiny_model()) is None
