"""How many tokens to draft: lossless drafts of the AR system at several lengths, on validation.

    .venv/bin/python benchmarks/draft_length.py [--system ar_rl] [--drafter rl] [--lookup 2 3 5]
        [--model-drafts 2 4 8] [--prompts 16] [--rounds 4] [--threads 2] [--split valid]

Times plain `--system` and each draft setting side by side at batch 1 (one request's latency),
under the answer grammar (as served) and free, on the first `--prompts` requests of `--split`
(validation: these figures choose `benchmark.timing.prompt_lookup_tokens` and `drafter_tokens`; the
benchmark reports on test). Rows: `+pld k` (prompt lookup, `DecodeConfig.draft="prompt"`) and
`+<drafter>-draft k` (a block-diffusion drafter, `draft="model"`, k at most its block size). Every
draft row writes the plain row's tokens (checked here on each prompt); the harness interleaves
rounds (`core/bench/harness.py`), and each speed-up is paired by round with its sign-test interval.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pandas as pd
import torch
from transformers import AutoTokenizer, PreTrainedModel

from diffusion_gr2.core.base.speed import statistic
from diffusion_gr2.core.bench.harness import TimedSystem, round_rates, table_row, time_rounds
from diffusion_gr2.core.decode.decoder import DecodeConfig, decode
from diffusion_gr2.core.decode.grammar import AnswerGrammar
from diffusion_gr2.core.model.factory import load_model
from diffusion_gr2.core.rank.rerank import RerankConfig, decode_config_for, request_grammars, select_requests

ROOT = Path(__file__).resolve().parents[1]
Request = tuple[list[int], AnswerGrammar | None]


def _system(
    model: PreTrainedModel, cfg: DecodeConfig, drafter: PreTrainedModel | None
) -> TimedSystem[Request]:
    def run(batch: list[Request]) -> list[tuple[int, int]]:
        prompts, grammars = [p for p, _ in batch], [g for _, g in batch]
        rows = None if grammars[0] is None else grammars
        return [(len(o.tokens), o.nfe) for o in decode(model, prompts, cfg, rows, drafter=drafter)]  # type: ignore[arg-type]

    return TimedSystem(run, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=ROOT / "data/06_models")
    parser.add_argument("--requests", type=Path, default=ROOT / "data/05_model_input/requests.parquet")
    parser.add_argument("--system", default="ar_rl")
    parser.add_argument("--drafter", default="rl")
    parser.add_argument("--lookup", nargs="*", type=int, default=[2, 3, 5])
    parser.add_argument("--model-drafts", nargs="*", type=int, default=[2, 4, 8])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--split", default="valid")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = AutoTokenizer.from_pretrained(args.models / "tokenizer", local_files_only=True)
    requests = select_requests(pd.read_parquet(args.requests), args.split, args.prompts)
    model = load_model(args.models / args.system).eval()
    drafter = load_model(args.models / args.drafter).eval() if args.model_drafts else None
    base = decode_config_for(model, tokenizer, None, RerankConfig(max_new_tokens=192, batch_size=1))
    settings: dict[str, tuple[DecodeConfig, PreTrainedModel | None]] = {args.system: (base, None)}
    for k in args.lookup:
        settings[f"{args.system}+pld {k}"] = (dataclasses.replace(base, draft="prompt", draft_tokens=k), None)
    for k in args.model_drafts:
        cfg = dataclasses.replace(base, draft="model", draft_tokens=k)
        settings[f"{args.system}+{args.drafter}-draft {k}"] = (cfg, drafter)
    prompts = [list(p) for p in requests["prompt_ids"]]
    print(
        f"{len(prompts)} {args.split} prompts, batch 1, {torch.get_num_threads()} threads; {statistic(args.rounds)}"
    )
    print(f"{'setting':34s} {'grammar':>7s} {'tok/s':>8s} {'NFE':>10s} {'tok/fwd':>8s}  speed-up vs plain")
    for constrained in (True, False):
        grammars = request_grammars(tokenizer, requests) if constrained else [None] * len(prompts)
        plain = [o.tokens for o in decode(model, prompts, base, None if not constrained else grammars)]  # type: ignore[arg-type]
        for name, (cfg, who) in settings.items():  # lossless: each draft setting writes the plain tokens
            got = decode(model, prompts, cfg, None if not constrained else grammars, drafter=who)  # type: ignore[arg-type]
            assert [o.tokens for o in got] == plain, f"{name} is not lossless"
        systems = {name: _system(model, cfg, who) for name, (cfg, who) in settings.items()}
        timed = time_rounds(systems, list(zip(prompts, grammars, strict=True)), args.rounds, desc="rounds")
        reference = round_rates(timed[args.system])
        for name, rounds in timed.items():
            print(table_row(name, rounds, reference, str(constrained)))


if __name__ == "__main__":
    main()
