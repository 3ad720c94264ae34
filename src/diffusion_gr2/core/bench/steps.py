"""What one decoding step of each kind runs, so its cost can be timed (`benchmarks/decode_profile.py`).

A step is one forward against the decoder's exact KV cache (`runner.CachedRunner.forward`) plus the
LM-head rows the decoder reads from it; on a 1M-parameter model with a ~2k vocabulary the LM head is
a large share of a step, so a kind that skips it is not the step the decoder runs (issue 28: the
profile once timed canvases with `lo=0`, an empty slice, i.e. no LM head at all). The kinds:

* `ar_step`: AR decoding (`decode.steps.first_token`): the token just written enters the cache, one LM-head row
  (it predicts the next token);
* `canvas_q`: a later step of a block (`decode.steps.run_block` without a clean part): q canvas positions fed,
  position 0 committed, the q - 1 masked positions after it read (lo = 1, the most such a step reads;
  q >= 2, since a step feeds at least its leftmost masked position and position 0 is committed);
* `fused_k+q`: the first step of a block under `fused`: the finished block's k clean tokens enter the
  cache together with the next block's first canvas of q positions, and q rows are read (the clean
  part's last position predicts the new block's first token, canvas positions 0..q-2 the others).

Every step leaves the cache as it found it, so the same step can be timed again and again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from diffusion_gr2.core.decode.runner import CachedRunner, lean_forward, left_pad_prompts, logit_columns
from diffusion_gr2.core.model.masks import prompt_response_layout

__all__ = ["DecodeStep", "StepRunner", "decode_steps"]


@dataclass(frozen=True)
class DecodeStep:
    """The shape of one decoding step: the arguments of `CachedRunner.forward`."""

    clean: int  # clean tokens that enter the cache (the token or block just written)
    canvas: int  # canvas positions fed (q)
    lo: int  # first canvas token whose logits are computed (0 with a clean part)

    @property
    def logit_rows(self) -> int:
        """LM-head rows the step computes per batch row (`runner.logit_columns`, the forward's own)."""
        columns = logit_columns(self.clean, self.canvas, self.lo, checked=0)
        return columns.stop - columns.start


def decode_steps(k: int, widths: Sequence[int] = (2, 4, 8, 16)) -> dict[str, DecodeStep]:
    """The step kinds of block size `k` (module doc), canvases of `widths` that fit in a block."""
    steps = {"ar_step": DecodeStep(clean=1, canvas=0, lo=0)}
    steps |= {f"canvas_{q}": DecodeStep(0, q, 1) for q in widths if 2 <= q <= k}
    steps |= {f"fused_{k}+{q}": DecodeStep(k, q, 0) for q in widths if q <= k}
    return steps


class StepRunner:
    """A cache holding one prompt (repeated `batch` times) and the steps run against it.

    State: the decoder's cached runner after the prompt's forward. `compiled` runs the lean forward
    under `torch.compile` (inductor, dynamic shapes), as `decode_profile.py --compile` compares.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        prompt: Sequence[int],
        batch: int,
        k: int,
        width: int,
        backend: str = "lean",
        compiled: bool = False,
    ) -> None:
        ids, valid = left_pad_prompts([list(prompt)] * batch, 0, model.device)  # [b, p] each
        response = torch.ones(batch, width, dtype=torch.bool, device=model.device)  # room for any step
        layout = prompt_response_layout(valid, response, k)
        lean = lean_forward(model, backend, layout.length)
        self.runner = CachedRunner(model, layout, lean)
        if compiled:
            if self.runner.lean is None:
                raise ValueError("compiled steps need the lean backend")
            self.runner.lean.hidden = torch.compile(self.runner.lean.hidden, dynamic=True)  # type: ignore[method-assign]
        self.runner.forward(ids, None, None)  # the prompt enters the cache
        self.batch = batch
        self.mask_id = int(getattr(model.config, "mask_token_id", None) or 1)

    def run(self, step: DecodeStep) -> Tensor:
        """The step's logits `[b, step.logit_rows, v]`; the cache is left as it was."""
        device = self.runner.layout.block.device
        n = self.runner.n
        clean = torch.full((self.batch, step.clean), self.mask_id, device=device) if step.clean else None
        canvas = torch.full((self.batch, step.canvas), self.mask_id, device=device) if step.canvas else None
        valid = None if canvas is None else torch.ones_like(canvas, dtype=torch.bool)
        logits = self.runner.forward(clean, canvas, valid, step.lo)
        if step.clean:  # forget the clean part again: the same cache for every timed step
            self.runner.cache.crop(-step.clean)
            self.runner.n = n
        return logits
