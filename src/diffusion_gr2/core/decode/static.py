"""The static runner: the decode step in a form CUDA graphs can capture (`DecodeConfig.static_cache`).

Same interface and same tokens as `runner.CachedRunner`; what differs is how a step is shaped:

* the KV cache is allocated once for the prompt and the longest answer (`static_cache.StaticCache`)
  and every step attends to all of it under a boolean key mask (`static_cache.static_mask`), never
  a slice of the live columns and never `attention_mask=None`;
* each step kind has a fixed query width (`static_cache.step_width`: the AR step 1, the canvas step
  k, the fused step k + k; other clean parts padded to a power of two), the padding written to
  cache slots nobody attends to;
* positions, cache slots and the mask are tensors the step reads, so no host-side shape changes
  inside a step. The step returns the hidden states of all `width` columns; the LM head runs after
  it on the columns the decoder reads only (as the cached runner's: a large share of a small
  model's step, and of a pretrained model's vocabulary-wide FLOPs).

On CUDA with `DecodeConfig.cuda_graphs` each (rows, width) step is captured once with
`torch.cuda.CUDAGraph` (static input and output buffers: copy in, replay, copy out) and replayed;
elsewhere the same step runs eagerly. The prefill (the prompt, of any width) always runs eagerly, as
serving systems do. The forward is `lean.LeanForward` (plain tensor ops); the `transformers`
modules (`backend: eager`) are refused by `config.check`.

What a capture reads outlives one `decode` batch (`StaticEngine`, one per model): the lean forward's
weights, the cache (capacity rounded up to `CAPACITY_STEP` columns, so batches of similar prompt
widths share it) and the graphs. It is rebuilt when a batch needs more rows or columns, and when
the model's weights changed since it was built (RL rollouts between optimiser steps: their
version counters moved), so a replay never runs stale weights. One decode at a time per model (the
decoder's batches run one after another; nothing here is thread-safe).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from diffusion_gr2.core.decode.runner import BaseRunner, Reblock, Slots
from diffusion_gr2.core.decode.static_cache import ROOM, StaticCache, static_mask, step_width
from diffusion_gr2.core.model.lean import LeanForward, lean_unsupported
from diffusion_gr2.core.model.masks import Layout

logger = logging.getLogger(__name__)

__all__ = ["CAPACITY_STEP", "StaticEngine", "StaticRunner", "StepInputs", "engine_for"]

CAPACITY_STEP = 64  # the cache's capacity is a multiple of this: one engine serves similar prompt widths


@dataclass(frozen=True)
class StepInputs:
    """What one static step reads: ids and positions `[b, w]`, cache slots `[w]`, mask `[b, 1, w, c]`."""

    ids: Tensor
    position: Tensor
    slots: Tensor
    mask: Tensor

    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.ids, self.position, self.slots, self.mask


Step = Callable[[StepInputs], Tensor]  # inputs -> hidden states `[b, w, h]`


class _Captured:
    """One step captured as a CUDA graph: static inputs, one replay per call, the output copied out.

    Warm-up runs on a side stream first (as torch.cuda.graphs documents): they write the same keys
    to the same slots as the replay that follows, so the cache is the same as after one eager step.
    """

    def __init__(self, step: Step, inputs: StepInputs) -> None:
        self.inputs = StepInputs(*(t.clone() for t in inputs.tensors()))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step(self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # a private memory pool: graphs never share intermediates
            self.out = step(self.inputs)

    def __call__(self, inputs: StepInputs) -> Tensor:
        for static, new in zip(self.inputs.tensors(), inputs.tensors(), strict=True):
            static.copy_(new)
        self.graph.replay()
        return self.out.clone()  # the next replay overwrites `out`


def _weights_state(model: PreTrainedModel) -> tuple[object, ...]:
    """What a capture's weights depend on: device, dtype and every parameter's version counter
    (bumped by any in-place write: an optimiser step, `load_state_dict`)."""
    return (model.device, model.dtype, *(p._version for p in model.parameters()))


class StaticEngine:
    """One model's static step: its lean forward, a cache of `rows` x `capacity`, its graphs."""

    def __init__(self, model: PreTrainedModel, rows: int, capacity: int, graphs: bool) -> None:
        self.rows, self.capacity, self.graphs = rows, capacity, graphs
        self.state = _weights_state(model)
        self.lean = LeanForward(model, capacity)  # rotary table: every position a layout can hold
        self.cache = StaticCache(model, rows, capacity)
        self.captured: dict[tuple[int, int], _Captured] = {}  # (rows, width) -> its graph

    def fits(self, model: PreTrainedModel, rows: int, capacity: int, graphs: bool) -> bool:
        return (
            rows <= self.rows
            and capacity <= self.capacity
            and graphs == self.graphs
            and self.state == _weights_state(model)
        )

    def step(self, inputs: StepInputs) -> Tensor:
        """The static step itself, what a graph captures: final hidden states `[b, w, h]`."""
        self.cache.cursor.slots = inputs.slots
        return self.lean.hidden(inputs.ids, inputs.position, inputs.mask, self.cache)  # type: ignore[arg-type]

    def run(self, inputs: StepInputs, exact: bool) -> Tensor:
        """The step, replayed from its graph where one is (or can now be) captured."""
        if not self.graphs or exact:
            return self.step(inputs)
        key = (inputs.ids.shape[0], inputs.ids.shape[1])  # (rows, width): the step's every shape
        if key not in self.captured:
            logger.debug("capturing the static step for %d rows, width %d", *key)
            self.captured[key] = _Captured(self.step, inputs)
        return self.captured[key](inputs)


_ENGINES: weakref.WeakKeyDictionary[PreTrainedModel, StaticEngine] = weakref.WeakKeyDictionary()


def engine_for(model: PreTrainedModel, rows: int, length: int, graphs: bool) -> StaticEngine:
    """`model`'s engine for a batch of `rows` rows and a layout of `length` columns: the last one
    where it fits, else a new one at least as large (the old one's memory is freed)."""
    why = lean_unsupported(model)
    if why is not None:
        raise ValueError(f"static_cache runs the lean forward (core/model/lean.py): {why}")
    graphs = graphs and model.device.type == "cuda"  # elsewhere the same step runs eagerly
    capacity = math.ceil((length + ROOM) / CAPACITY_STEP) * CAPACITY_STEP
    old = _ENGINES.get(model)
    if old is not None and old.fits(model, rows, capacity, graphs):
        return old
    if old is not None and old.graphs == graphs and old.state == _weights_state(model):
        rows, capacity = max(rows, old.rows), max(capacity, old.capacity)
    _ENGINES.pop(model, None)  # before allocating the new cache: never two alive
    engine = StaticEngine(model, rows, capacity, graphs)
    _ENGINES[model] = engine
    return engine


class StaticRunner(BaseRunner):
    """Forwards of `[clean | canvas]` as fixed-width static steps against a fixed-capacity cache."""

    def __init__(self, model: PreTrainedModel, layout: Layout, block_size: int, graphs: bool) -> None:
        self.model, self.layout, self.k = model, layout, block_size
        rows = layout.block.shape[0]
        if graphs and model.device.type != "cuda":
            logger.debug("cuda_graphs on %s: the static step runs eagerly", model.device)
        self.engine = engine_for(model, rows, layout.length, graphs)
        self.cache = self.engine.cache
        self.n = 0
        self.slots = Slots(rows, self._swap)

    def _inputs(self, ids: Tensor, lay: Layout, width: int) -> StepInputs:
        """The step's tensors: `ids` `[b, c + q]` padded to `width`, at the layout's positions."""
        b, fed = ids.shape
        dev = ids.device
        padded = torch.full((b, width), self.model.config.pad_token_id or 0, dtype=ids.dtype, device=dev)
        padded[:, :fed] = ids
        position = torch.zeros(b, width, dtype=lay.position.dtype, device=dev)  # padding: position 0
        position[:, :fed] = lay.position[:, self.n :]
        slots = torch.arange(self.n, self.n + width, device=dev)
        mask = static_mask(lay, self.n, width, self.cache.capacity, own=self.n == 0)
        return StepInputs(padded, position, slots, mask)

    def _hidden(self, ids: Tensor, lay: Layout, c: int, reblock: Reblock | None) -> Tensor:
        """One static step: hidden states of all its `width` columns (the fed ones first). The
        canvas's keys stay in slots past `n`, dead until overwritten; `lay` holds any `reblock`."""
        # the prefill (any prompt width) and a step that would overrun the cache run at their width
        width = step_width(c, ids.shape[1] - c, self.k)
        exact = self.n == 0 or self.n + width > self.cache.capacity
        return self.engine.run(self._inputs(ids, lay, ids.shape[1] if exact else width), exact)

    def _keep_rows(self, index: Tensor) -> None:
        self.cache.keep(index)  # in the first rows of the same buffers (captured graphs read them)

    def _swap_rows(self, i: int, j: int, perm: Tensor) -> None:
        self.cache.swap_rows(i, j)

    def _drop_columns(self, drop: int) -> None:
        pass  # the columns past `n` are dead until overwritten, as a canvas's are
