"""Tiny random Qwen3 models and a word-level tokenizer for the model and decode tests."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import transformers.integrations.flex_attention as hf_flex
from tokenizers import Tokenizer, models
from torch.nn.attention.flex_attention import flex_attention
from transformers import PreTrainedModel, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

VOCAB = 128
PAD, MASK, EOS = 0, 1, 2  # ids in `tiny_tokenizer`

# The model, decode and replay tests run on the CPU. `DIFFUSION_GR2_TEST_DEVICE=cuda` runs the same
# tests on a GPU (benchmarks/device_check.sh), where the flex-attention tests use the compiled kernel.
DEVICE = torch.device(os.environ.get("DIFFUSION_GR2_TEST_DEVICE", "cpu"))
# fp32 logits of different kernels (eager, SDPA, flex; cached vs recomputed) agree to ~1e-6 on the
# CPU; GPU kernels reorder their sums more, so comparisons there allow ten times more.
ATOL = 1e-5 if DEVICE.type == "cpu" else 1e-4


def tiny_config(attn: str = "sdpa") -> Qwen3Config:
    """hidden 64, 2 layers, 4 heads / 2 kv heads: a forward costs well under a millisecond."""
    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.1,
        pad_token_id=PAD,
        attn_implementation=attn,
    )


def tiny_model(attn: str = "sdpa", head_scale: float = 5.0, seed: int = 0) -> PreTrainedModel:
    """A random model whose LM head is scaled so predictions are often confident.

    An unscaled random model is almost uniform: every block step would commit exactly one token and
    the threshold rule would never be exercised.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(tiny_config(attn)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model.to(DEVICE)


def same_weights(model: PreTrainedModel, attn: str) -> PreTrainedModel:
    """`model`'s weights behind another attention backend (config deep-copied: switching mutates it)."""
    config = copy.deepcopy(model.config)
    config._attn_implementation = attn
    twin = Qwen3ForCausalLM(config).eval()
    twin.load_state_dict(model.state_dict())
    return twin.to(DEVICE)


def uncompiled_flex_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU, flex attention without `torch.compile`: the same BlockMask and maths.

    transformers compiles flex attention on first use (~20 s per shape on CPU with inductor), so on
    the CPU the flex tests check the mask, not the kernel; on a GPU they run the compiled kernel.
    """
    if DEVICE.type == "cpu":
        monkeypatch.setattr(
            hf_flex,
            "compile_friendly_flex_attention",
            lambda q, k, v, training=False, **kw: flex_attention(q, k, v, **kw),
        )


def tiny_tokenizer(size: int = VOCAB) -> PreTrainedTokenizerFast:
    """Word-level tokenizer with `size` tokens: `<pad>` 0, `[MASK]` 1, `<|im_end|>` 2, then w3, w4..."""
    vocab = {"<pad>": PAD, "[MASK]": MASK, "<|im_end|>": EOS} | {f"w{i}": i for i in range(3, size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", mask_token="[MASK]", eos_token="<|im_end|>"
    )


def random_prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    """Prompts of the given lengths drawn from the ordinary tokens (no pad / mask / eos)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def tiny_model_for(
    tokenizer: PreTrainedTokenizerFast, block_size: int | None = None, num_layers: int = 1
) -> PreTrainedModel:
    """A random Qwen3 over `tokenizer` (one layer by default); a block-diffusion config when
    `block_size` is given. Two layers make keys/values depend on attention (a wrong mask shows)."""
    from diffusion_gr2.core.model.factory import ModelSpec, build_model

    spec = ModelSpec(
        hidden_size=32,
        num_layers=num_layers,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=64,
        tie_embeddings=False,
    )
    model = build_model(spec, tokenizer)
    if block_size is not None:  # what conversion writes into the config
        model.config.block_size = block_size
        model.config.mask_token_id = tokenizer.mask_token_id
    return model.to(DEVICE)
