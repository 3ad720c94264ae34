"""FSDP2 for the stages that decode with the model between optimiser steps (`ar_rl`, OPD, RL).

FSDP's default all-gathers a shard unit in its pre-forward and frees it in its post-forward: one
collective per call, so every process must call every unit the same number of times. Rollouts break
that: the decoder calls the model a data-dependent number of times (rows finish early, blocks commit
at different rates), and so does the replay the diffusion losses run (one forward per block of the
longest rollout). Processes would issue different numbers of all-gathers and hang.

So for those stages every unit is all-gathered once at the start of an optimiser step, in the same
order on every process, and held through the step's rollouts, forwards and backwards; FSDP still
reduce-scatters each unit's gradient once, after its last use in the backward, in the same (reverse
layer) order on every process. The shards are put back before clipping and the optimiser step, which
work on them. The price is the full weights (in FSDP's parameter dtype) resident for the whole step,
which decoding needs anyway; gradients and AdamW state stay sharded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.fsdp import FSDPModule

__all__ = ["held_units", "full_weights"]


def held_units(wrapped: torch.nn.Module) -> list[FSDPModule]:
    """The FSDP2 units of ``wrapped`` (its root first), set to keep their full weights once gathered.

    Call once after ``wrapped`` is sharded and before any forward. Without units (not sharded): ``[]``.
    """
    units = [m for m in wrapped.modules() if isinstance(m, FSDPModule)]
    if not units:
        return []
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.set_reshard_after_backward(False, recurse=False)
    # The decoder calls the model's layers, not the root's forward, and FSDP2 makes the first unit to
    # run a forward the root of all others: initialise the real root before any rollout.
    units[0]._get_fsdp_state()._lazy_init()
    return units


@contextlib.contextmanager
def full_weights(units: list[FSDPModule]) -> Iterator[None]:
    """Every unit's full weights gathered on entry (one all-gather each, in a fixed order) and given
    back as shards on exit; a no-op without units."""
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
