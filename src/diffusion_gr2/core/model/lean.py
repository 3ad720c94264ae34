"""The decoder's forward pass of a Qwen3 model, written out in a few tensor ops (`backend: lean`).

Why: the default model is small (4 layers, hidden 128), so a decode step is bound by operator
dispatch, not arithmetic, and most of `transformers`' forward is per-call overhead: keyword
plumbing, mask and rotary helpers, and for grouped-query attention a copy of the whole cache per
layer (`repeat_kv`). Measured on two cores with the default `rl` model (prompt 260 tokens): one
token 4.2 -> 2.1 ms at batch 1; a 4-position canvas 5.0 -> 2.4 ms at batch 1 and 11.3 -> 5.9 ms at
batch 16. The AR and the diffusion decoder use the same forward, so their ratio stays honest.

Same weights (read from the live modules at every `decode` call, so RL rollouts see the current
policy), same arithmetic as `modeling_qwen3` (RMSNorm in float32, q/k norms before RoPE, SDPA with
the same boolean mask), the same cache (`kv_cache.BufferLayer`). `tests/core/model/test_lean.py` pins equal
hidden states and equal decoded tokens against the `transformers` forward (`backend: eager`), which
stays the reference. Any model this does not cover is refused with the reason, never approximated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import Cache, PreTrainedModel

__all__ = ["LeanForward", "lean_unsupported"]


def lean_unsupported(model: PreTrainedModel) -> str | None:
    """Why `LeanForward` cannot run `model` exactly (None = it can)."""
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    checks = [
        (cfg.model_type == "qwen3", f"model_type {cfg.model_type!r} (only 'qwen3')"),
        (not getattr(cfg, "attention_bias", False), "attention_bias"),
        (not getattr(cfg, "use_sliding_window", False), "sliding-window attention"),
        (rope.get("rope_type", "default") == "default", f"rope_type {rope.get('rope_type')!r}"),
        (cfg.hidden_act == "silu", f"hidden_act {cfg.hidden_act!r}"),
    ]
    reasons = [why for ok, why in checks if not ok]
    return None if not reasons else "lean backend does not support " + ", ".join(reasons)


@dataclass(frozen=True)
class _LayerWeights:
    input_norm: Tensor
    qkv: Tensor  # q, k and v projections stacked: one matmul instead of three
    qk_norm: Tensor  # [heads + kv_heads, head_dim]: q_norm per query head, then k_norm per key head
    out: Tensor
    post_norm: Tensor
    gate_up: Tensor  # gate and up projections stacked
    down: Tensor


class LeanForward:
    """`hidden(ids, position, mask, cache)`: final hidden states of `ids` run after `cache`.

    Op count is what a step costs here, so queries and keys are normalised and rotated together
    (one view of `[heads + kv_heads]` heads) and norms are `F.rms_norm`.
    """

    def __init__(self, model: PreTrainedModel, positions: int | None = None) -> None:
        """`positions`: how many positions a decode uses (the rotary table's length; default the model's)."""
        why = lean_unsupported(model)
        if why is not None:
            raise ValueError(f"{why}; decode with backend 'eager'")
        cfg, base = model.config, model.base_model
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.cos, self.sin = self._rotary_table(
            float(cfg.rope_parameters["rope_theta"]), positions or cfg.max_position_embeddings, model
        )
        self.embed, self.final_norm = base.embed_tokens.weight, base.norm.weight
        self.layers = [self._weights(layer) for layer in base.layers]

    def _weights(self, layer: torch.nn.Module) -> _LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        return _LayerWeights(
            input_norm=layer.input_layernorm.weight,
            qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
            qk_norm=torch.cat(
                [attn.q_norm.weight.expand(self.heads, -1), attn.k_norm.weight.expand(self.kv_heads, -1)]
            ),
            out=attn.o_proj.weight,
            post_norm=layer.post_attention_layernorm.weight,
            gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
            down=mlp.down_proj.weight,
        )

    def _norm(self, x: Tensor, weight: Tensor | None = None) -> Tensor:
        if x.dtype == torch.float32:  # the fused kernel: the same sums as Qwen3RMSNorm
            return F.rms_norm(x, x.shape[-1:], weight, self.eps)
        # half precision: Qwen3RMSNorm normalises in float32 and scales after casting back
        y = F.rms_norm(x.float(), x.shape[-1:], None, self.eps).to(x.dtype)
        return y if weight is None else weight * y

    def _rotary_table(self, theta: float, n: int, model: PreTrainedModel) -> tuple[Tensor, Tensor]:
        """cos and signed sin `[n, d]` of positions 0..n-1 (float32 angles, as `Qwen3RotaryEmbedding`).

        A step then gathers its rows instead of a dozen trig and concat ops per forward.
        rotate_half(x) = cat(-x2, x1) is roll(x, d/2) with the first half negated, so the sign goes
        into sin once instead of a neg and a cat per layer.
        """
        d = self.head_dim
        inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=model.device) / d)
        freqs = torch.arange(n, dtype=torch.float32, device=model.device)[:, None] * inv_freq
        cos = torch.cat([freqs.cos(), freqs.cos()], -1)
        sin = torch.cat([-freqs.sin(), freqs.sin()], -1)
        return cos.to(model.dtype), sin.to(model.dtype)

    def hidden(self, ids: Tensor, position: Tensor, mask: Tensor, cache: Cache) -> Tensor:
        """Final hidden states `[b, q, h]`; the keys/values of `ids` are appended to `cache`.

        `mask` is boolean (True = may attend), broadcastable to `[b, heads, q, cached + q]`.
        """
        b, q = ids.shape
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        qk_width = (heads + kv_heads) * d
        x = F.embedding(ids, self.embed)
        cos, sin = self.cos[position][:, :, None], self.sin[position][:, :, None]  # [b, q, 1, d]
        for weights, layer_cache in zip(self.layers, cache.layers, strict=True):
            h = F.linear(self._norm(x, weights.input_norm), weights.qkv)
            qk = self._norm(h[..., :qk_width].view(b, q, heads + kv_heads, d)) * weights.qk_norm
            qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin).transpose(1, 2)  # RoPE
            value = h[..., qk_width:].view(b, q, kv_heads, d).transpose(1, 2)
            keys, values = layer_cache.update(qk[:, heads:], value)
            attn = F.scaled_dot_product_attention(qk[:, :heads], keys, values, mask, enable_gqa=True)
            x = x + F.linear(attn.transpose(1, 2).reshape(b, q, -1), weights.out)
            gate, up = F.linear(self._norm(x, weights.post_norm), weights.gate_up).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, weights.down)
        return self._norm(x, self.final_norm)
