"""Decoding variants side by side on validation: block writes, windows, taus, drafts, citations.

    .venv/bin/python benchmarks/decode_variants.py [--systems ar_rl rl] [--taus 0.9 0.6 0.4]
        [--windows 0 4 8] [--modes fused separate] [--jump on off] [--copy off on] [--draft-tokens 3]
        [--cite off on] [--sid-taus 0 0.95] [--sid-scopes answer list] [--reference ar_rl] [--split valid]
        [--max-users N] [--threads 2] [--json OUT.json]

Every variant decodes the same requests of `--split` (validation by default: these figures choose
settings, test only reports them) under the answer grammar, as served, with the trained models in
`data/06_models`. Per variant: R@1 as served, the model's own valid rate (its free answer accepted
by the grammar), tokens per forward and output tokens/s of the pass.
* `fused` writes a finished block in the next block's first forward (the default); `separate` runs
  it alone first (one forward more per block, the first token known before the canvas).
* Window 0 = the whole block.
* `--copy on`: copy drafts (`DecodeConfig.copy_drafts`: prompt-lookup continuations fed as
  tokens, committed where the model agrees; decoder.py). Diffusion systems only.
* `--cite on`: the explanation cites only the prompt's SIDs, the rest of a pinned citation forced
  (`RerankConfig.cite_prompt_sids`); own validity is then read under that stricter grammar.
* `--sid-taus`: the tau a SID code must clear (`RerankConfig.sid_threshold`; 0 = the variant's tau);
  `--sid-scopes`: where (`RerankConfig.sid_scope`: every SID code, or the ranking list's only).
* AR systems decode once per `--cite` (no tau, window or copy drafts).
Each variant after a system's first at the same tau gets its R@1 difference from that first one on
the same requests, paired (whole users resampled, 1000 times), and with `--reference ar_rl` its
difference from that system's plain decode (as the operating point pairs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from transformers import AutoTokenizer

from diffusion_gr2.core.evaluate.metrics import (
    paired_bootstrap,
    prompt_contexts,
    reasoning_values,
    system_metrics,
    user_values,
)
from diffusion_gr2.core.evaluate.policy import Policy
from diffusion_gr2.core.model.factory import load_model
from diffusion_gr2.core.rank.rerank import (
    SID_SCOPES,
    RerankConfig,
    decode_config_for,
    request_grammars,
    rerank,
    select_requests,
)

ROOT = Path(__file__).resolve().parents[1]
LEVEL = Policy().level  # the serving policy's interval level (conf/base's `policy.level`)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=ROOT / "data/06_models")
    parser.add_argument("--requests", type=Path, default=ROOT / "data/05_model_input/requests.parquet")
    parser.add_argument("--systems", nargs="+", default=["rl"])
    parser.add_argument("--taus", nargs="+", type=float, default=[0.9, 0.6, 0.4])
    parser.add_argument("--windows", nargs="+", type=int, default=[0])
    parser.add_argument("--modes", nargs="+", default=["fused", "separate"], choices=["fused", "separate"])
    parser.add_argument("--jump", nargs="+", default=["on"], choices=["on", "off"], help="jump-forward")
    parser.add_argument("--copy", nargs="+", default=["off"], choices=["off", "on"], help="copy drafts")
    parser.add_argument("--draft-tokens", type=int, default=3, help="copy drafts: positions drafted a step")
    parser.add_argument(
        "--cite", nargs="+", default=["off"], choices=["off", "on"], help="explanation cites prompt SIDs only"
    )
    parser.add_argument(
        "--repeat-gate", nargs="+", default=["off"], choices=["off", "on"], help="DecodeConfig.repeat_gate"
    )
    parser.add_argument(
        "--sid-taus", nargs="+", type=float, default=[0.0], help="tau for SID codes (0 = the tau itself)"
    )
    parser.add_argument(
        "--sid-scopes",
        nargs="+",
        default=["answer"],
        choices=list(SID_SCOPES),
        help="where the SID tau holds",
    )
    parser.add_argument("--split", default="valid")
    parser.add_argument("--reference", default=None, help="an AR system every variant is paired with (ar_rl)")
    parser.add_argument("--max-users", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = AutoTokenizer.from_pretrained(args.models / "tokenizer", local_files_only=True)
    requests = select_requests(pd.read_parquet(args.requests), args.split, args.max_users)
    grammars = request_grammars(tokenizer, requests)
    cited = request_grammars(tokenizer, requests, cite_prompt_sids=True) if "on" in args.cite else None
    config = RerankConfig(max_new_tokens=192, batch_size=args.batch_size)
    contexts = prompt_contexts(requests, tokenizer.decode)
    rows = []
    firsts: dict[tuple[str, float | None], np.ndarray] = {}  # each (system, tau)'s first variant's hits
    ref_hits = None
    if args.reference:  # decoded once, as served
        ref = load_model(args.models / args.reference).eval()
        cfg = decode_config_for(ref, tokenizer, None, config)
        ref_frame = rerank(ref, requests, tokenizer, cfg, args.reference, None, grammars, args.split)
        ref_hits = user_values(ref_frame)["recall@1"]
        print(f"{args.reference}: R@1 {ref_hits.mean():.3f}")
    print(f"{len(requests)} {args.split} requests, {torch.get_num_threads()} threads")
    print(
        f"{'system':6s} {'tau':>4s} {'win':>3s} {'mode':8s} {'jump':>4s} {'copy':>4s} {'cite':>4s} {'sid':>9s} {'rep':>4s} "
        f"{'R@1':>6s} "
        f"{'vs first [95%]':>22s} {'own valid':>9s} {'tok/fwd':>7s} {'tok/s':>6s} {'grounded':>8s}"
    )
    for system in args.systems:
        model = load_model(args.models / system).eval()
        diffusion = getattr(model.config, "block_size", None) is not None
        for tau in args.taus if diffusion else [None]:  # AR systems: one setting, no copy drafts
            for window in args.windows if diffusion else [0]:
                copies, modes = (args.copy, args.modes) if diffusion else (["off"], ["fused"])
                sid_taus = args.sid_taus if diffusion else [0.0]
                # a scope matters only where there is a SID tau
                sids = [(t, scope) for t in sid_taus for scope in (args.sid_scopes if t else ["answer"])]
                for mode, jump, copy, cite, (sid_tau, scope), gate in itertools.product(
                    modes, args.jump, copies, args.cite, sids, args.repeat_gate
                ):
                    sid_config = dataclasses.replace(config, sid_threshold=sid_tau or None, sid_scope=scope)
                    cfg = decode_config_for(model, tokenizer, tau, sid_config, window=window or None)
                    cfg = dataclasses.replace(
                        cfg,
                        fused=mode == "fused",
                        jump_forward=jump == "on",
                        copy_drafts=copy == "on",
                        draft_tokens=args.draft_tokens,
                        repeat_gate=gate == "on",
                    )
                    served = cited if cite == "on" else grammars
                    frame = rerank(model, requests, tokenizer, cfg, system, tau, served, args.split)
                    metrics = system_metrics(frame, n_boot=200)
                    hits = user_values(frame)["recall@1"]  # per request
                    first = firsts.setdefault((system, tau), hits)
                    diff = None
                    users = frame["user_id"].to_numpy()
                    if first is not hits:
                        diff = paired_bootstrap(hits, first, level=LEVEL, groups=users)
                    vs_ref = (
                        None
                        if ref_hits is None
                        else paired_bootstrap(hits, ref_hits, level=LEVEL, groups=users)
                    )
                    tokens = int(frame["output_tokens"].sum())
                    grounded = reasoning_values(frame, contexts, len)["grounded_rate"].mean()
                    row = {
                        "system": system,
                        "tau": tau,
                        "window": window or None,
                        "mode": mode,
                        "jump_forward": jump == "on",
                        "copy_drafts": copy == "on",
                        "cite_prompt_sids": cite == "on",
                        "sid_threshold": sid_tau or None,
                        "sid_scope": scope,
                        "repeat_gate": gate == "on",
                        "n": len(frame),
                        "recall@1": metrics["recall@1"],
                        "recall@1_ci": metrics["ci"]["recall@1"],
                        "recall@1_vs_first": None if diff is None else [diff.mean_diff, diff.low, diff.high],
                        "recall@1_vs_reference": None
                        if vs_ref is None
                        else [vs_ref.mean_diff, vs_ref.low, vs_ref.high],
                        "unforced_rate": metrics["unforced_rate"],
                        "prerank_copy_rate": metrics["prerank_copy_rate"],
                        "grounded_rate": float(grounded),
                        "tokens_per_forward": tokens / int(frame["nfe"].sum()),
                        "tokens_per_s": tokens / frame.attrs["decode_s"],
                    }
                    rows.append(row)
                    vs = "" if diff is None else f"{diff.mean_diff:+.3f} [{diff.low:+.3f}, {diff.high:+.3f}]"
                    if vs_ref is not None:
                        vs += f"  vs {args.reference} {vs_ref.mean_diff:+.3f} [{vs_ref.low:+.3f}, {vs_ref.high:+.3f}]"
                    print(
                        f"{system:6s} {'AR' if tau is None else f'{tau:g}':>4s} {window or '-':>3} {mode:8s} "
                        f"{jump:>4s} {copy:>4s} {cite:>4s} {f'{sid_tau:g} {scope}' if sid_tau else '-':>9} {gate:>4s} "
                        f"{row['recall@1']:6.3f} {vs:>22s} {row['unforced_rate']:9.1%} "
                        f"{row['tokens_per_forward']:7.2f} {row['tokens_per_s']:6.0f} {grounded:8.1%}"
                    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
