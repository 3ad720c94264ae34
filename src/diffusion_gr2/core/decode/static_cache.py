"""The static step's pieces: a KV cache of fixed capacity written at slots given as a tensor, the
step's query widths, and its mask over the whole capacity (`static.py` runs them).

A CUDA graph replays the kernels it captured on the memory it captured them with, so nothing a
step reads may change shape or move between replays: the cache is allocated once for the prompt
and the longest answer (plus `ROOM` columns for a padded step's tail), every step attends to all of
it, and which keys are live is a boolean mask, never a slice. The slots a step writes are a tensor
(`index_copy_`), so the host's column counter never reaches the captured kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel

from diffusion_gr2.core.model.masks import Layout

__all__ = ["ROOM", "Cursor", "StaticCache", "StaticLayer", "static_mask", "step_width"]

# Columns past the layout: a padded step writes its padding keys there near the end of the answer
# (the keys nobody attends to). A step that would overrun them runs at its exact width instead.
ROOM = 32


def step_width(c: int, q: int, k: int) -> int:
    """The fixed query width of a step of `c` clean tokens and a canvas of `q <= k` positions.

    The kinds (docs/architecture.md#the-static-decode-step-cuda-graphs): the AR step (c = 1 -> 1), the canvas
    step (c = 0 -> k), the fused step (c = k beside the next canvas -> c' + k). Clean parts of other lengths
    (AR jump-forward's forced tokens, `fused=False`'s block alone) are padded to the next power of two, so a
    decode meets a handful of widths, each captured once.
    """
    clean = 0 if c == 0 else 1 << (c - 1).bit_length()
    return clean + (k if q else 0)


class Cursor:
    """The slots `[w]` (cache columns) the current step writes, shared by every layer of a cache."""

    def __init__(self) -> None:
        self.slots: Tensor | None = None


class StaticLayer:
    """One layer's keys/values `[rows, kv_heads, capacity, d]`, allocated once and never moved."""

    def __init__(self, keys: Tensor, values: Tensor, cursor: Cursor) -> None:
        self.keys, self.values, self.cursor = keys, values, cursor

    def update(self, key_states: Tensor, value_states: Tensor) -> tuple[Tensor, Tensor]:
        """Write `[b, h, w, d]` at the cursor's slots of the first b rows; return those rows' whole
        buffers (the mask says which keys are live)."""
        assert self.cursor.slots is not None, "a step sets its slots before the forward"
        b = key_states.shape[0]  # the rows taking part are the first ones (`runner.Slots`): views
        self.keys[:b].index_copy_(2, self.cursor.slots, key_states)
        self.values[:b].index_copy_(2, self.cursor.slots, value_states)
        return self.keys[:b], self.values[:b]


class StaticCache:
    """`StaticLayer`s for every decoder layer of `model`: `rows` rows of `capacity` columns."""

    def __init__(self, model: PreTrainedModel, rows: int, capacity: int) -> None:
        cfg = model.config.get_text_config(decoder=True)
        shape = (rows, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.capacity, self.cursor = capacity, Cursor()

        def buffer() -> Tensor:  # zeros, not empty: a masked key must be finite (0 * NaN = NaN)
            return torch.zeros(shape, dtype=model.dtype, device=model.device)

        self.layers = [StaticLayer(buffer(), buffer(), self.cursor) for _ in range(cfg.num_hidden_layers)]

    def swap_rows(self, i: int, j: int) -> None:
        """Exchange rows i and j in place (the buffers stay where a captured graph reads them)."""
        for layer in self.layers:
            for buf in (layer.keys, layer.values):
                row_i = buf[i].clone()
                buf[i] = buf[j]
                buf[j] = row_i

    def keep(self, index: Tensor) -> None:
        """Rows `index` move to the first rows, in that order, in place."""
        n = index.shape[0]
        for layer in self.layers:
            layer.keys[:n] = layer.keys[index]  # the gather copies first: no row is read after it is written
            layer.values[:n] = layer.values[index]


def static_mask(lay: Layout, start: int, width: int, capacity: int, own: bool) -> Tensor:
    """Boolean mask `[b, 1, width, capacity]` of a step whose queries are `lay`'s columns `start ..`
    (then padding up to `width`), against every slot of the cache.

    Keys past `lay` are dead. A query sees the valid keys of blocks up to its own: the predicate of
    `masks.block_attention_predicate` without noisy copies, which is also the cached runner's
    validity row wherever every key's block is at most the query's (a canvas alone, an AR token).
    `own`: every query also sees its own key, as the predicate has it (the prefill: a padded prompt
    position sees nothing else). Padding queries see only their own key (none would give NaN).
    """
    b, end = lay.block.shape
    dev = lay.block.device
    q = end - start
    key_block = torch.zeros(b, capacity, dtype=lay.block.dtype, device=dev)
    key_block[:, :end] = lay.block
    key_valid = torch.zeros(b, capacity, dtype=torch.bool, device=dev)
    key_valid[:, :end] = lay.valid
    query_block = torch.full((b, width), -1, dtype=lay.block.dtype, device=dev)  # padding: no block
    query_block[:, :q] = lay.block[:, start:]
    mask = (key_block[:, None, None, :] <= query_block[:, None, :, None]) & key_valid[:, None, None, :]
    slot = torch.arange(capacity, device=dev)
    diagonal = slot[None, :] == (start + torch.arange(width, device=dev))[:, None]  # [width, capacity]
    if not own:
        diagonal &= (torch.arange(width, device=dev) >= q)[:, None]
    return mask | diagonal
