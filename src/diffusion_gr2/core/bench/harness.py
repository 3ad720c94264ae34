"""The one timing harness: every speed the project reports is measured here, one way.

How (issue 28). The compared systems answer the same requests. Each first gets `warmup` untimed
calls (allocator, kernel selection, caches), then `rounds` rounds follow; in every round each system
makes its calls one after another, so a machine whose speed drifts (shared cores, thermal limits)
slows every system of that round alike. A call always decodes a full batch: requests are cycled,
and each round goes on where the last one stopped, so the rounds together cover the requests evenly.
Per system and round the harness keeps the calls (wall time, output tokens and forwards per row).

The statistic every timing is stated in (the median over rounds, paired sign-test intervals of
the speed-ups) is `core/base/speed.py`'s.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from tqdm.auto import tqdm

from diffusion_gr2.core.base.speed import speedup, tokens_per_s

__all__ = [
    "Call",
    "TimedSystem",
    "calls_per_round",
    "cycled_batches",
    "round_rates",
    "table_row",
    "time_rounds",
]

K = TypeVar("K")
T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    """One timed call: its wall time and, per row, output tokens and forwards (NFE)."""

    latency_s: float
    output_tokens: list[int]
    nfe: list[int]


@dataclass(frozen=True)
class TimedSystem(Generic[T]):
    """A system the harness times: one call decodes one full batch of `batch_size` requests.

    `run(batch)` returns (output tokens, forwards) per row; `sync` waits for queued device work so
    the clock measures it (GPU kernels are asynchronous; CPU work needs nothing).
    """

    run: Callable[[list[T]], Sequence[tuple[int, int]]]
    batch_size: int
    sync: Callable[[], None] = lambda: None


def cycled_batches(items: Sequence[T], batch_size: int, n_batches: int, start: int = 0) -> list[list[T]]:
    """`n_batches` batches of exactly `batch_size` items, cycling through `items` from index `start`."""
    if not items:
        raise ValueError("timing needs at least one request")
    flat = [items[(start + i) % len(items)] for i in range(n_batches * batch_size)]
    return [flat[i : i + batch_size] for i in range(0, len(flat), batch_size)]


def calls_per_round(batch_size: int, n_requests: int, rounds: int, min_calls: int) -> int:
    """Timed calls of a system in each round: `min_calls` in all, and every request decoded at least once."""
    total = max(min_calls, math.ceil(n_requests / batch_size))
    return math.ceil(total / rounds)


def _timed_call(system: TimedSystem[T], batch: list[T], clock: Callable[[], float]) -> Call:
    start = clock()
    counts = system.run(batch)
    system.sync()
    latency = clock() - start
    return Call(latency, [t for t, _ in counts], [n for _, n in counts])


def time_rounds(
    systems: Mapping[K, TimedSystem[T]],
    requests: Sequence[T],
    rounds: int,
    warmup: int = 1,
    min_calls: int = 1,
    clock: Callable[[], float] = time.perf_counter,
    desc: str | None = None,
) -> dict[K, list[list[Call]]]:
    """Each system's calls per round `[rounds][calls]` (module doc: warm-up, interleaving, full batches).

    Every system makes `calls_per_round` calls a round; `warmup` untimed calls each (on its first
    batch) come before the first round. `desc` shows a progress bar.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    for system in systems.values():
        for _ in range(warmup):
            system.run(cycled_batches(requests, system.batch_size, 1)[0])
        system.sync()
    out: dict[K, list[list[Call]]] = {key: [] for key in systems}
    with tqdm(total=len(systems) * rounds, desc=desc, unit="system", disable=desc is None) as bar:
        for r in range(rounds):
            for key, system in systems.items():
                b = system.batch_size
                n = calls_per_round(b, len(requests), rounds, min_calls)
                batches = cycled_batches(requests, b, n, start=r * n * b)
                out[key].append([_timed_call(system, batch, clock) for batch in batches])
                bar.update()
    return out


def round_rates(rounds: Sequence[Sequence[Call]]) -> list[float]:
    """Output tokens per second of each round: the round's tokens over its seconds (nan for no time)."""
    rates = []
    for calls in rounds:
        seconds = sum(c.latency_s for c in calls)
        rates.append(sum(sum(c.output_tokens) for c in calls) / seconds if seconds > 0 else math.nan)
    return rates


def table_row(
    name: str, rounds: Sequence[Sequence[Call]], reference: Sequence[float], label: str = ""
) -> str:
    """One printed line of a side-by-side table (the benchmarks' scripts): the setting, tokens/s,
    forwards per row, tokens per forward and the speed-up over `reference`'s per-round rates."""
    calls = [c for r in rounds for c in r]
    tokens, nfe = sum(sum(c.output_tokens) for c in calls), sum(sum(c.nfe) for c in calls)
    rows = sum(len(c.output_tokens) for c in calls)
    ratio = speedup(round_rates(rounds), reference)
    return (
        f"{name:34s} {label:>7s} {tokens_per_s(round_rates(rounds)):8.1f} {nfe / max(rows, 1):10.1f} "
        f"{tokens / max(nfe, 1):8.2f}  {ratio.value:.2f} [{ratio.low:.2f}, {ratio.high:.2f}]"
    )
