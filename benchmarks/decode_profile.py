"""Where decoding time goes: model forward vs the rest (grammar, commit rule, bookkeeping).

    .venv/bin/python benchmarks/decode_profile.py [--systems ar_rl rl] [--taus 0.9 0.6] [--windows 0 4]
        [--batch-sizes 1 16] [--backends lean eager] [--n 16] [--threads 2] [--no-fused] [--free]
        [--no-jump] [--compile] [--json OUT.json]

Decodes the first `--n` test requests of the trained models in `data/06_models/<system>` (as the
`benchmark` pipeline does: the answer grammar on unless `--free`) and splits the wall time into
* `forward`: the decoder's model calls (`_CachedRunner.forward`: transformer and LM head),
* `grammar`: the answer grammar's checks and corrections (`_constrain_commits`),
* `other`: everything else (commit rule, canvas bookkeeping, Python between forwards).
For diffusion it also splits tokens and forwards by part of the answer: the blocks of the
explanation, the block where the ranking list starts, and the list's blocks. Then it times one forward against the cache of a real prompt for canvases of 1, 2, 4, 8 and 16
positions (and a fused forward: a clean block plus the canvas), at each batch size, as a ratio to a
one-token step (`--compile`: also with the lean forward under `torch.compile`). Window 0 on the
command line means the whole block. `--backends` compares the
model forwards side by side (`lean`, the default, and `eager`, the transformers modules).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from transformers import AutoTokenizer, PreTrainedModel

from diffusion_gr2.core.decode import decoder
from diffusion_gr2.core.decode.decoder import DecodeConfig, _CachedRunner, decode, left_pad_prompts
from diffusion_gr2.core.model.factory import load_model
from diffusion_gr2.core.model.masks import prompt_response_layout
from diffusion_gr2.core.rank.rerank import RerankConfig, decode_config_for, request_grammars, select_requests

ROOT = Path(__file__).resolve().parents[1]
TIMERS: dict[str, float] = defaultdict(float)


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMERS[name] += time.perf_counter() - start

    return wrapper


def _regions(outputs: list, tokenizer: Any, k: int) -> dict[str, dict[str, float]]:
    """Tokens and forwards of the blocks before the ranking list (`explanation`), after its key
    (`ranking`), and the one block that holds the boundary, summed over `outputs`.

    A block's forwards are its last commit step (fused decoding: the first forward is step 1).
    """
    out: dict[str, dict[str, float]] = {}
    for o in outputs:
        text, start = "", len(o.tokens)
        for i, token in enumerate(o.tokens):  # the first token after which the list's key is written
            text += tokenizer.decode([token])
            if '"recommendations"' in text:
                start = i
                break
        for lo in range(0, len(o.tokens), k):
            region = "ranking" if lo > start else "explanation" if lo + k <= start else "boundary"
            cell = out.setdefault(region, {"tokens": 0, "forwards": 0})
            cell["tokens"] += len(o.tokens[lo : lo + k])
            cell["forwards"] += max(o.commit_steps[lo : lo + k])
    for cell in out.values():
        cell["tokens_per_forward"] = cell["tokens"] / max(cell["forwards"], 1)
    return out


def _profile_decode(
    model: PreTrainedModel, prompts: list[list[int]], cfg: DecodeConfig, grammars: list | None, tokenizer: Any
) -> dict[str, Any]:
    """One decode call (after a warm-up), its wall time split into forward / grammar / other."""
    decode(model, prompts[: cfg.batch_size], cfg, None if grammars is None else grammars[: cfg.batch_size])
    TIMERS.clear()
    start = time.perf_counter()
    outputs = decode(model, prompts, cfg, grammars)
    wall = time.perf_counter() - start
    tokens, nfe = sum(len(o.tokens) for o in outputs), sum(o.nfe for o in outputs)
    forward, grammar = TIMERS["forward"], TIMERS["grammar"]
    regions = _regions(outputs, tokenizer, cfg.block_size) if cfg.block_size > 1 else {}
    return {
        "regions": regions,
        "wall_s": wall,
        "forward_s": forward,
        "grammar_s": grammar,
        "other_s": wall - forward - grammar,
        "forwards": TIMERS["calls"],
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "tokens_per_forward": tokens / nfe,
        "ms_per_forward_call": 1000 * forward / max(TIMERS["calls"], 1),
    }


def _canvas_costs(
    model: PreTrainedModel,
    prompt: list[int],
    batch: int,
    k: int,
    repeats: int,
    backend: str,
    compiled: bool = False,
) -> dict[str, float]:
    """ms of one forward against a cached prompt: canvases of 1..16 positions, and a fused forward.

    `compiled`: the lean forward under `torch.compile` (inductor, dynamic shapes); every shape is
    run once before it is timed, so compiling is not in the figures.
    """
    ids, valid = left_pad_prompts([prompt] * batch, 0, model.device)
    width = 2 * k + 32  # room for a clean block and the widest canvas
    layout = prompt_response_layout(valid, torch.ones(batch, width, dtype=torch.bool, device=model.device), k)
    runner = _CachedRunner(model, layout, decoder._lean_forward(model, backend, layout.length))
    if compiled:
        assert runner.lean is not None, "--compile needs the lean backend"
        runner.lean.hidden = torch.compile(runner.lean.hidden, dynamic=True)  # type: ignore[method-assign]
    runner.forward(ids, None, None)
    mask_id = int(getattr(model.config, "mask_token_id", None) or 1)
    out = {}
    for q in (1, 2, 4, 8, 16):
        canvas = torch.full((batch, q), mask_id, device=model.device)
        valid_q = torch.ones_like(canvas, dtype=torch.bool)
        runner.forward(None, canvas, valid_q)
        start = time.perf_counter()
        for _ in range(repeats):
            runner.forward(None, canvas, valid_q)
        out[f"canvas_{q}"] = 1000 * (time.perf_counter() - start) / repeats
    block = torch.full((batch, k), mask_id, device=model.device)
    for q in (4, 8, 16):
        canvas = torch.full((batch, q), mask_id, device=model.device)
        valid_q = torch.ones_like(canvas, dtype=torch.bool)
        elapsed = 0.0
        for rep in range(repeats + 1):  # the first, untimed: allocations (and compiling)
            n = runner.n
            start = time.perf_counter()
            runner.forward(block, canvas, valid_q)
            elapsed += (time.perf_counter() - start) if rep else 0.0
            for layer in runner.cache.layers:  # forget the clean block again: the same cache every time
                layer.crop(-k)
            runner.n = n
        out[f"fused_{k}+{q}"] = 1000 * elapsed / repeats
    return out


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=ROOT / "data/06_models")
    parser.add_argument("--requests", type=Path, default=ROOT / "data/05_model_input/requests.parquet")
    parser.add_argument("--systems", nargs="+", default=["ar_rl", "rl"])
    parser.add_argument("--taus", nargs="+", type=float, default=[0.9])
    parser.add_argument("--windows", nargs="+", type=int, default=[0])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--backends", nargs="+", default=["lean", "eager"], choices=decoder.BACKENDS)
    parser.add_argument("--n", type=int, default=16, help="requests decoded per setting")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20, help="forwards per canvas-cost figure")
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--no-fused", action="store_true", help="the block's own forward writes it")
    parser.add_argument("--free", action="store_true", help="no answer grammar")
    parser.add_argument(
        "--compile", action="store_true", help="forward costs also with the lean forward under torch.compile"
    )
    parser.add_argument("--no-jump", action="store_true", help="no jump-forward over forced tokens")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    decoder._CachedRunner.forward = _timed("forward", decoder._CachedRunner.forward)  # type: ignore[method-assign]
    decoder._constrain_commits = _timed("grammar", decoder._constrain_commits)  # type: ignore[assignment]
    inner = decoder._CachedRunner.forward

    def counted(self: _CachedRunner, *a: Any, **kw: Any) -> Any:
        TIMERS["calls"] += 1
        return inner(self, *a, **kw)

    decoder._CachedRunner.forward = counted  # type: ignore[method-assign]

    tokenizer = AutoTokenizer.from_pretrained(args.models / "tokenizer", local_files_only=True)
    requests = select_requests(pd.read_parquet(args.requests), "test", args.n)
    prompts = [list(p) for p in requests["prompt_ids"]]
    report: dict[str, Any] = {"settings": [], "canvas_ms": {}}
    print(
        f"{len(prompts)} requests, {torch.get_num_threads()} threads, grammar {'off' if args.free else 'on'}"
    )
    print(
        f"{'system':6s} {'backend':7s} {'tau':>4s} {'win':>3s} {'batch':>5s} {'tok/s':>7s} {'tok/fwd':>7s} {'fwd ms':>6s} "
        f"{'forward':>8s} {'grammar':>8s} {'other':>8s}"
    )
    for system in args.systems:
        model = load_model(args.models / system).eval()
        block_size = int(getattr(model.config, "block_size", 1) or 1)
        is_ar = system.startswith("ar_")
        for tau in [None] if is_ar else args.taus:
            for window in [0] if is_ar else args.windows:
                for batch, backend in itertools.product(args.batch_sizes, args.backends):
                    base = RerankConfig(max_new_tokens=args.max_new_tokens, batch_size=batch)
                    cfg = decode_config_for(model, tokenizer, tau, base)
                    cfg = dataclasses.replace(
                        cfg,
                        window=window or None,
                        fused=not args.no_fused,
                        backend=backend,
                        jump_forward=not args.no_jump,
                    )
                    grammars = None if args.free else request_grammars(tokenizer, requests)
                    row = _profile_decode(model, prompts, cfg, grammars, tokenizer)
                    wall = row["wall_s"]
                    print(
                        f"{system:6s} {backend:7s} {tau or '-':>4} {window or '-':>3} {batch:5d} {row['tokens_per_s']:7.0f} "
                        f"{row['tokens_per_forward']:7.2f} {row['ms_per_forward_call']:6.2f} "
                        f"{row['forward_s'] / wall:8.0%} {row['grammar_s'] / wall:8.0%} {row['other_s'] / wall:8.0%}"
                    )
                    if row["regions"]:
                        print(
                            "        tokens/forward by part of the answer: "
                            + ", ".join(
                                f"{name} {c['tokens_per_forward']:.2f} ({c['forwards']} forwards)"
                                for name, c in row["regions"].items()
                            )
                        )
                    report["settings"].append(
                        {"system": system, "backend": backend, "tau": tau, "window": window, "batch": batch}
                        | row
                    )
        if not is_ar:
            variants = [(b, f, False) for b, f in itertools.product(args.batch_sizes, args.backends)]
            if args.compile:  # the compiled lean forward beside the eager one, same shapes
                variants += [(b, "lean", True) for b in args.batch_sizes]
            for batch, backend, compiled in variants:
                costs = _canvas_costs(model, prompts[0], batch, block_size, args.repeats, backend, compiled)
                one = costs["canvas_1"]
                text = "  ".join(f"{k} {v:.2f}ms ({v / one:.2f}x)" for k, v in costs.items())
                name = backend + ("+compiled" if compiled else "")
                print(f"forward cost, {system}, {name}, batch {batch}: {text}")
                report["canvas_ms"][f"{system}@{batch}/{name}"] = costs
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
