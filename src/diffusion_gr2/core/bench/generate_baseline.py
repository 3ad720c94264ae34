"""`transformers` `generate` as the decode benchmark's third row: greedy, KV cache, same weights
(docs/architecture.md#decoding).

The benchmark times the AR teacher twice: with our decoder (block size 1) and with the library's own
`model.generate`, the baseline a sceptic would reach for. Both see the same left-padded prompts, the
same end-of-output ids and the same token budget, so they must write the same tokens (the AR decoder's
tests pin B = 1 == `generate`).

Constrained, `generate` runs each request's answer grammar as a `LogitsProcessor`: before every
arg-max the tokens a row's grammar does not allow get -inf. That is exactly the AR decoder's rule (a
disallowed arg-max is replaced by the best allowed token, with the budget the row has left), so the
constrained outputs equal `decode(..., constraints=...)` token for token; the grammar's per-token
Python walk is paid by both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel

from diffusion_gr2.core.decode.decoder import DecodeConfig, left_pad_prompts
from diffusion_gr2.core.decode.grammar import TokenConstraint

__all__ = ["GrammarLogitsProcessor", "generate_tokens"]


class GrammarLogitsProcessor(LogitsProcessor):
    """One `TokenConstraint` per batch row, applied to `generate`'s next-token scores.

    State: each row's constraint (a copy) and whether the row has ended. At each call the token the
    previous step chose is fed to the row's constraint (`advance`), then the scores of tokens it does
    not allow (`allowed(budget)`, budget = tokens the row may still write) are set to -inf. Rows that
    wrote an end-of-output token are left alone: `generate` pads them from then on.
    """

    def __init__(
        self,
        constraints: Sequence[TokenConstraint],
        prompt_width: int,
        max_new_tokens: int,
        eos_token_ids: Sequence[int],
    ) -> None:
        self.states = [c.copy() for c in constraints]  # never mutate the caller's constraints
        self.width, self.max_new = prompt_width, max_new_tokens
        self.eos = set(eos_token_ids)
        self.live = [True] * len(self.states)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        """`input_ids` [b, p + n] (prompt + n tokens written), `scores` [b, v] -> masked scores [b, v]."""
        written = input_ids.shape[1] - self.width
        if written > 0:
            for i, token in enumerate(input_ids[:, -1].tolist()):
                if self.live[i]:
                    self.states[i].advance(token)
                    self.live[i] = token not in self.eos
        rows, masks = [], []
        for i, state in enumerate(self.states):
            allowed = state.allowed(self.max_new - written) if self.live[i] else None
            if allowed is not None:  # None: any token (e.g. inside a free part of the answer)
                rows.append(i), masks.append(allowed)
        if not rows:
            return scores
        blocked = ~torch.stack(masks).to(scores.device)  # [r, v]
        index = torch.tensor(rows, device=scores.device)
        scores = scores.clone()
        scores[index] = scores[index].masked_fill(blocked, -math.inf)
        return scores


def _cut(row: list[int], eos: set[int], max_new_tokens: int) -> list[int]:
    """A generated row up to and including its first end-of-output token (padding after it dropped)."""
    end = next((i for i, t in enumerate(row) if t in eos), None)
    return row[: max_new_tokens if end is None else end + 1]


@torch.inference_mode()
def generate_tokens(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    config: DecodeConfig,
    constraints: Sequence[TokenConstraint] | None = None,
    prompt_lookup: int | None = None,
) -> list[list[int]]:
    """Greedy `model.generate` with a KV cache, `config.batch_size` prompts per call, in order.

    Uses `config.max_new_tokens`, `eos_token_ids` and `pad_token_id` (left padding, as our decoder);
    each output ends with (and includes) its eos token, as `DecodeOutput.tokens` does. One forward per
    output token, so a row's NFE is its length. `constraints`, one per prompt, are copied, never mutated.
    `prompt_lookup`: `generate`'s own prompt-lookup decoding with that many draft tokens (lossless;
    the library allows it at batch 1 only).
    """
    if prompt_lookup and config.batch_size != 1:
        raise ValueError(f"generate's prompt lookup decodes one prompt a call, not {config.batch_size}")
    if constraints is not None and len(constraints) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(constraints)} constraints")
    eos = list(config.eos_token_ids)
    outputs: list[list[int]] = []
    for start in range(0, len(prompts), config.batch_size):
        chunk = prompts[start : start + config.batch_size]
        ids, valid = left_pad_prompts(chunk, config.pad_token_id, model.device)  # [b, p] each
        processors = LogitsProcessorList()
        if constraints is not None:
            rows = constraints[start : start + config.batch_size]
            processors.append(GrammarLogitsProcessor(rows, ids.shape[1], config.max_new_tokens, eos))
        out = model.generate(
            ids,
            attention_mask=valid.long(),
            do_sample=False,
            num_beams=1,
            max_new_tokens=config.max_new_tokens,
            eos_token_id=eos or None,
            pad_token_id=config.pad_token_id,
            use_cache=True,
            logits_processor=processors,
            **({"prompt_lookup_num_tokens": int(prompt_lookup)} if prompt_lookup else {}),
        )  # [b, p + n]
        outputs += [_cut(row, set(eos), config.max_new_tokens) for row in out[:, ids.shape[1] :].tolist()]
    return outputs
