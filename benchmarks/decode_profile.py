"""Where decoding time goes: model forward vs the rest (grammar, commit rule, bookkeeping).

    .venv/bin/python benchmarks/decode_profile.py [--systems ar_rl rl] [--taus 0.9 0.6] [--windows 0 4]
        [--batch-sizes 1 16] [--backends lean eager] [--n 16] [--split test] [--threads 2] [--no-fused]
        [--free] [--no-jump] [--sid-tau 0.99] [--sid-scopes answer list] [--compile] [--rounds 3]
        [--cost-rounds 15] [--repeats 10] [--json OUT.json]
    .venv/bin/python benchmarks/decode_profile.py --random [--vocab 2256] [--block-size 8] [--prompt-len 262]

Decodes the first `--n` requests of `--split` (test) with the trained models in
`data/06_models/<system>` (as the `benchmark` pipeline does: the answer grammar on unless `--free`)
and splits the wall time into
* `forward`: the decoder's model calls (`CachedRunner.forward`: transformer and LM head),
* `grammar`: the answer grammar's checks and corrections (`constrain.constrain_commits`),
* `other`: everything else (commit rule, canvas bookkeeping, Python between forwards).
For diffusion it also splits tokens and forwards by part of the answer: the blocks of the
explanation, the block where the ranking list starts, and the list's blocks. Window 0 on the command
line means the whole block; `--backends` compares the model forwards side by side (`lean`, the
default, and `eager`, the transformers modules). `--sid-tau 0.99` decodes diffusion systems with the
SID threshold as served (`inference.decoding.sid_threshold`), and `--sid-scopes answer list` times
where it holds side by side (`RerankConfig.sid_scope`).

Then the forward-cost table: what one decoding step of each kind costs (`core/bench/steps.py`: an AR
step = one new token and one LM-head row; `canvas_q` = a later block step, q positions fed and the
q - 1 masked rows read; `fused_k+q` = a finished block of k with the next canvas of q, q rows read),
each relative to the AR step, at each batch size (`--compile`: also with the lean forward under
`torch.compile`). The cost of a forward does not depend on the weights, so `--random` times a random
model of the default size (`ModelSpec()`, the default vocabulary and block size, a prompt of the
default length) when no trained models are at hand; it prints only this table.

Everything is timed with the one harness (`core/bench/harness.py`): the decode settings of every
system interleaved over `--rounds` rounds (each call decodes the `--n` requests), the step kinds of a
model and batch size over `--cost-rounds` rounds of `--repeats` steps each, after a warm-up call each;
figures are medians over rounds, ratios paired by round with their sign-test intervals, and the
statistic is printed and written to the JSON file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from tokenizers import Tokenizer, models
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.base.speed import interval_fields, speedup, statistic, tokens_per_s
from diffusion_gr2.core.bench.harness import Call, TimedSystem, round_rates, time_rounds
from diffusion_gr2.core.bench.steps import StepRunner, decode_steps
from diffusion_gr2.core.decode import decoder
from diffusion_gr2.core.decode import steps as decoder_steps
from diffusion_gr2.core.decode.decoder import DecodeConfig, decode
from diffusion_gr2.core.decode.runner import CachedRunner
from diffusion_gr2.core.model.diffusion import as_block_diffusion
from diffusion_gr2.core.model.factory import ModelSpec, build_model, load_model
from diffusion_gr2.core.rank.rerank import (
    SID_SCOPES,
    RerankConfig,
    decode_config_for,
    request_grammars,
    select_requests,
)

ROOT = Path(__file__).resolve().parents[1]
TIMERS: dict[str, float] = defaultdict(float)


def _sync() -> None:
    if torch.cuda.is_available():  # GPU work is asynchronous: wait for it before reading the clock
        torch.cuda.synchronize()


@contextlib.contextmanager
def _instrumented() -> Iterator[None]:
    """The decoder's forward and grammar calls timed into `TIMERS` (forward calls counted), then restored."""
    forward, constrain = CachedRunner.forward, decoder_steps.constrain_commits

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                TIMERS[name] += time.perf_counter() - start
                if name == "forward":
                    TIMERS["calls"] += 1

        return wrapper

    CachedRunner.forward = timed("forward", forward)  # type: ignore[method-assign]
    decoder_steps.constrain_commits = timed("grammar", constrain)  # type: ignore[assignment]
    try:
        yield
    finally:
        CachedRunner.forward, decoder_steps.constrain_commits = forward, constrain  # type: ignore[method-assign]


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


@dataclasses.dataclass
class _Profiled:
    """One decode setting as a harness system: each call decodes every request, in batches of
    `cfg.batch_size`; per call the forward / grammar time and forward count it spent, and the last
    call's outputs (greedy: every call writes the same tokens)."""

    model: PreTrainedModel
    cfg: DecodeConfig
    requests: list[tuple[list[int], Any]]
    spent: list[dict[str, float]] = dataclasses.field(default_factory=list)
    outputs: list = dataclasses.field(default_factory=list)

    def system(self) -> TimedSystem[tuple[list[int], Any]]:
        def run(batch: list[tuple[list[int], Any]]) -> list[tuple[int, int]]:
            before = dict(TIMERS)
            grammars = [g for _, g in batch]
            self.outputs = decode(
                self.model, [p for p, _ in batch], self.cfg, None if None in grammars else grammars
            )
            self.spent.append({k: TIMERS[k] - before.get(k, 0.0) for k in ("forward", "grammar", "calls")})
            return [(len(o.tokens), o.nfe) for o in self.outputs]

        return TimedSystem(run, len(self.requests), _sync)

    def summary(self, rounds: list[list[Call]], warmup: int, tokenizer: Any) -> dict[str, Any]:
        """The setting's figures over its timed calls (the first `warmup` calls were untimed)."""
        spent = self.spent[warmup:]
        wall = sum(c.latency_s for r in rounds for c in r)
        forward, grammar = (sum(s[k] for s in spent) for k in ("forward", "grammar"))
        calls = sum(s["calls"] for s in spent)
        tokens, nfe = sum(len(o.tokens) for o in self.outputs), sum(o.nfe for o in self.outputs)
        k = self.cfg.block_size
        return {
            "regions": _regions(self.outputs, tokenizer, k) if k > 1 else {},
            "wall_s": wall,
            "forward_s": forward,
            "grammar_s": grammar,
            "other_s": wall - forward - grammar,
            "forwards": calls,
            "tokens": tokens,  # of one call (every request once)
            "tokens_per_s": tokens_per_s(round_rates(rounds)),
            "tokens_per_s_by_round": round_rates(rounds),
            "tokens_per_forward": tokens / nfe,
            "ms_per_forward_call": 1000 * forward / max(calls, 1),
        }


def _step_costs(
    model: PreTrainedModel,
    prompt: list[int],
    batch: int,
    backend: str,
    compiled: bool,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """ms of each decoding step kind against a cached prompt, and its cost relative to an AR step.

    Each kind is one harness system whose call runs `args.repeats` steps; the warm-up call also
    compiles each shape under `compiled`, so compiling is not in the figures.
    """
    k = int(getattr(model.config, "block_size", 1) or 1)
    steps = decode_steps(k)
    width = k + max(s.canvas for s in steps.values())  # room for a clean block and the widest canvas
    runner = StepRunner(model, prompt, batch, k, width, backend, compiled)

    def kind(step: Any) -> TimedSystem[int]:
        def run(_: list[int]) -> list[tuple[int, int]]:
            for _ in range(args.repeats):
                runner.run(step)
            return [(args.repeats, args.repeats)]  # "tokens" = steps: rates are steps per second

        return TimedSystem(run, 1, _sync)

    timed = time_rounds({name: kind(s) for name, s in steps.items()}, [0], args.cost_rounds)
    rates = {name: round_rates(rounds) for name, rounds in timed.items()}
    ar = rates["ar_step"]
    return {
        "ms": {name: 1000 / tokens_per_s(r) for name, r in rates.items()},
        # cost relative to an AR step = AR steps per second / this kind's, paired by round
        "cost": {name: interval_fields("ratio", speedup(ar, r)) for name, r in rates.items()},
        "logit_rows": {name: s.logit_rows for name, s in steps.items()},
    }


def _print_costs(name: str, costs: dict[str, Any]) -> None:
    cells = "  ".join(
        f"{kind} {costs['ms'][kind]:.3f}ms {c['ratio']:.2f}x [{c['ratio_low']:.2f}, {c['ratio_high']:.2f}]"
        f" ({costs['logit_rows'][kind]} rows)"
        for kind, c in costs["cost"].items()
    )
    print(f"forward cost, {name}: {cells}")


def _random_model(args: argparse.Namespace) -> tuple[PreTrainedModel, list[int]]:
    """A random model of the default size (`ModelSpec()`), block size and vocabulary, and a prompt."""
    vocab = {"<pad>": 0, "[MASK]": 1} | {f"w{i}": i for i in range(2, args.vocab)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>",
        mask_token="[MASK]",
    )
    model = as_block_diffusion(build_model(ModelSpec(), tokenizer), args.block_size, 1).eval()
    gen = torch.Generator().manual_seed(0)
    return model, torch.randint(2, args.vocab, (args.prompt_len,), generator=gen).tolist()


def _cost_variants(args: argparse.Namespace) -> list[tuple[int, str, bool]]:
    variants = [(b, f, False) for b, f in itertools.product(args.batch_sizes, args.backends)]
    if args.compile:  # the compiled lean forward beside the eager one, same shapes
        variants += [(b, "lean", True) for b in args.batch_sizes]
    return variants


def _step_table(name: str, model: PreTrainedModel, prompt: list[int], args: argparse.Namespace) -> dict:
    """The forward-cost table of one model at every batch size and backend, printed; keyed `name@b/backend`."""
    out = {}
    for batch, backend, compiled in _cost_variants(args):
        costs = _step_costs(model, prompt, batch, backend, compiled, args)
        key = f"{name}@{batch}/{backend}{'+compiled' if compiled else ''}"
        _print_costs(key, costs)
        out[key] = costs
    return out


def _decode_profile(args: argparse.Namespace, tokenizer: Any, requests: pd.DataFrame) -> list[dict[str, Any]]:
    """Every decode setting of every system, interleaved by the harness; one row each, printed."""
    prompts = [list(p) for p in requests["prompt_ids"]]
    grammars = [None] * len(prompts) if args.free else request_grammars(tokenizer, requests)
    shared = list(zip(prompts, grammars, strict=True))  # every setting decodes the same requests
    profiled: dict[tuple, _Profiled] = {}
    for system in args.systems:
        model = load_model(args.models / system).eval()
        is_ar = system.startswith("ar_")
        scopes = [None] if is_ar or not args.sid_tau else args.sid_scopes  # a scope needs a SID tau
        for tau, window, scope in itertools.product(
            [None] if is_ar else args.taus, [0] if is_ar else args.windows, scopes
        ):
            for batch, backend in itertools.product(args.batch_sizes, args.backends):
                if len(prompts) % batch:
                    raise SystemExit(
                        f"--n {len(prompts)} is not a multiple of batch size {batch}: full batches only"
                    )
                base = RerankConfig(
                    max_new_tokens=args.max_new_tokens,
                    batch_size=batch,
                    sid_threshold=args.sid_tau or None,
                    sid_scope=scope or "answer",
                )
                cfg = dataclasses.replace(
                    decode_config_for(model, tokenizer, tau, base),
                    window=window or None,
                    fused=not args.no_fused,
                    backend=backend,
                    jump_forward=not args.no_jump,
                )
                profiled[(system, backend, tau, window, scope, batch)] = _Profiled(model, cfg, shared)
    with _instrumented():
        timed = time_rounds({k: p.system() for k, p in profiled.items()}, shared, args.rounds)
    rows = []
    for key, p in profiled.items():
        system, backend, tau, window, scope, batch = key
        row = p.summary(timed[key], 1, tokenizer)
        setting = {"system": system, "backend": backend, "tau": tau, "window": window, "sid_scope": scope}
        rows.append(setting | {"batch": batch} | row)
    _add_speedups(rows)
    return rows


def _add_speedups(rows: list[dict[str, Any]]) -> None:
    """Each row's speed-up against the AR system at the same batch size and backend, paired by round."""
    ar = {(r["batch"], r["backend"]): r for r in rows if r["system"].startswith("ar_")}
    for r in rows:
        ref = ar.get((r["batch"], r["backend"]))
        ratio = None if ref is None else speedup(r["tokens_per_s_by_round"], ref["tokens_per_s_by_round"])
        r.update(interval_fields("speedup_vs_ar", ratio))


def _print_rows(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'system':6s} {'backend':7s} {'tau':>4s} {'win':>3s} {'scope':>6s} {'batch':>5s} {'tok/s':>7s} {'tok/fwd':>7s} "
        f"{'fwd ms':>6s} {'forward':>8s} {'grammar':>8s} {'other':>8s}  vs AR [interval]"
    )
    for row in rows:
        wall = row["wall_s"]
        vs = (
            "-"
            if row["speedup_vs_ar"] is None
            else (
                f"{row['speedup_vs_ar']:.2f} [{row['speedup_vs_ar_low']:.2f}, {row['speedup_vs_ar_high']:.2f}]"
            )
        )
        print(
            f"{row['system']:6s} {row['backend']:7s} {row['tau'] or '-':>4} {row['window'] or '-':>3} "
            f"{row['sid_scope'] or '-':>6} "
            f"{row['batch']:5d} {row['tokens_per_s']:7.0f} {row['tokens_per_forward']:7.2f} "
            f"{row['ms_per_forward_call']:6.2f} {row['forward_s'] / wall:8.0%} {row['grammar_s'] / wall:8.0%} "
            f"{row['other_s'] / wall:8.0%}  {vs}"
        )
        if row["regions"]:
            print(
                "        tokens/forward by part of the answer: "
                + ", ".join(
                    f"{name} {c['tokens_per_forward']:.2f} ({c['forwards']} forwards)"
                    for name, c in row["regions"].items()
                )
            )


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=ROOT / "data/06_models")
    parser.add_argument("--requests", type=Path, default=ROOT / "data/05_model_input/requests.parquet")
    parser.add_argument("--systems", nargs="+", default=["ar_rl", "rl"])
    parser.add_argument("--taus", nargs="+", type=float, default=[0.9])
    parser.add_argument("--windows", nargs="+", type=int, default=[0])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--backends", nargs="+", default=["lean", "eager"], choices=decoder.BACKENDS)
    parser.add_argument(
        "--n", type=int, default=16, help="requests decoded per call (a multiple of each batch size)"
    )
    parser.add_argument("--split", default="test", choices=["valid", "test"], help="whose first --n requests")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the decode settings")
    parser.add_argument("--cost-rounds", type=int, default=15, help="interleaved rounds of the step kinds")
    parser.add_argument("--repeats", type=int, default=10, help="steps per call of a step kind")
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--no-fused", action="store_true", help="the block's own forward writes it")
    parser.add_argument("--free", action="store_true", help="no answer grammar")
    parser.add_argument(
        "--compile", action="store_true", help="forward costs also with the lean forward under torch.compile"
    )
    parser.add_argument("--no-jump", action="store_true", help="no jump-forward over forced tokens")
    parser.add_argument(
        "--sid-tau",
        type=float,
        default=0.0,
        help="the tau a SID code must clear (inference.decoding.sid_threshold, 0.99 as served; 0 = tau)",
    )
    parser.add_argument(
        "--sid-scopes",
        nargs="+",
        default=["answer"],
        choices=list(SID_SCOPES),
        help="where the SID tau holds",
    )
    parser.add_argument(
        "--random", action="store_true", help="forward costs of a random default-size model only"
    )
    parser.add_argument(
        "--vocab", type=int, default=2256, help="--random: 2000 BPE tokens + 4 x 64 SID tokens"
    )
    parser.add_argument(
        "--block-size", type=int, default=8, help="--random: the default conversion block size"
    )
    parser.add_argument("--prompt-len", type=int, default=262, help="--random: the default prompt length")
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args()


@torch.inference_mode()
def main() -> None:
    args = _arguments()
    torch.set_num_threads(args.threads)
    report: dict[str, Any] = {
        "statistic": statistic(args.rounds),
        "step_statistic": statistic(args.cost_rounds),
        "sid_threshold": args.sid_tau or None,
        "settings": [],
        "step_costs": {},
    }
    print(
        f"{torch.get_num_threads()} threads; tokens/s: {report['statistic']}; steps: {report['step_statistic']}"
    )
    if args.random:
        model, prompt = _random_model(args)
        report["model"] = (
            f"random ModelSpec(), vocab {args.vocab}, block {args.block_size}, prompt {args.prompt_len}"
        )
        report["step_costs"] = _step_table("random", model, prompt, args)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.models / "tokenizer", local_files_only=True)
        requests = select_requests(pd.read_parquet(args.requests), args.split, args.n)
        print(f"{len(requests)} {args.split} requests, grammar {'off' if args.free else 'on'}")
        report["settings"] = _decode_profile(args, tokenizer, requests)
        _print_rows(report["settings"])
        prompt = list(requests["prompt_ids"].iloc[0])
        for system in (s for s in args.systems if not s.startswith("ar_")):
            report["step_costs"] |= _step_table(system, load_model(args.models / system).eval(), prompt, args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
