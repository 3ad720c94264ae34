"""The decoder's golden dump: every configuration the pipelines, operating points and benchmarks use,
decoded on small seeded random models, recorded token for token.

A refactor of `core/decode/` must leave this dump unchanged (tokens, commit steps, forwards and
corrections exactly; log-probs to `logprob_tolerance`, float32's rounding on any CPU and thread
count): `test_golden.py` checks it against `golden_decode.json`.

    .venv/bin/python -m tests.core.decode.golden --train --write tests/core/decode/golden_decode.json
    .venv/bin/python -m tests.core.decode.golden --check tests/core/decode/golden_decode.json

Models: a two-layer AR model and a two-layer block-diffusion model (block 8) over the synthetic
world's tokenizer (SID tokens, answer grammar), trained for a few seconds on the world's answers
(`--train`, kept in `golden_models.safetensors` so the check never depends on training numerics): a
random model commits one token a forward and is always overridden by the grammar, so it never
exercises tau, the SID threshold or drafts. Settings are built by `decode_config_for`, the one
builder inference, the benchmark, serving and rollouts use.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.decode.decoder import DecodeConfig, DecodeOutput, decode
from diffusion_gr2.core.rank.rerank import RerankConfig, decode_config_for, request_grammars
from diffusion_gr2.core.text.prompt import render_answer
from diffusion_gr2.core.text.tokenizer import IM_END
from tests.core.model.tiny import tiny_model_for
from tests.core.rank.world import make_world

BLOCK = 8  # the default recipe's block size
MAX_NEW = 96  # room for a 10-SID answer under the grammar, a short explanation before it
N_PROMPTS = 6  # rows of the batched cases (batch 6: one batch, rows of different lengths)
N_ALONE = 2  # rows of the batch-1 cases (each decodes alone: the same paths, 3x cheaper than 6)
WEIGHTS = Path(__file__).with_name("golden_models.safetensors")  # the trained weights (`--train`)


@dataclass(frozen=True)
class Case:
    """One decode: which model, which settings, which grammar, how many prompts, which drafter."""

    model: str  # "ar" or "dm"
    tau: float | None  # None = AR (block size 1)
    rerank: RerankConfig
    grammar: str | None  # None = free, "plain" = the answer grammar, "cited" = cite_prompt_sids
    n: int = N_PROMPTS
    window: int | None = None
    sample_seed: int | None = None  # rollouts: sampled at temperature 1 with this seed
    drafter: str | None = None  # "dm" or "twin" (the AR model's weights as a block-4 drafter)
    extra: tuple[tuple[str, Any], ...] = ()  # DecodeConfig fields set after the builder (fused, ...)


def _rerank(**kw: Any) -> RerankConfig:
    """The case's settings; the SID gate and the repeat gate off unless the case names them (`served`):
    the recorded outputs predate the repeat gate, which tests/core/decode/test_decoder.py covers."""
    return RerankConfig(
        **{"max_new_tokens": MAX_NEW, "batch_size": N_PROMPTS, "sid_threshold": None, "repeat_gate": False}
        | kw
    )


def cases() -> dict[str, Case]:
    """Every configuration, by name: AR (inference, benchmark rows, rollouts) and diffusion (the
    operating-point candidates, the benchmark's tau sweep, variants the benchmarks time)."""
    out: dict[str, Case] = {}
    served = {"sid_threshold": 0.99}  # inference.decoding as served
    for batch, n in ((N_PROMPTS, N_PROMPTS), (1, N_ALONE)):
        tag = f"b{batch}"
        for g in (None, "plain"):
            gtag = g or "free"
            out[f"ar/{gtag}/{tag}"] = Case("ar", None, _rerank(batch_size=batch), g, n)
            for k in (1, 3):  # benchmark ar_rl+pld (3), the shortest draft
                rr = _rerank(batch_size=batch, draft="prompt", draft_tokens=k)
                out[f"ar+pld{k}/{gtag}/{tag}"] = Case("ar", None, rr, g, n)
            for who in ("dm", "twin"):  # benchmark ar_rl+rl-draft: the drafter's whole block
                dk = BLOCK if who == "dm" else 4
                rr = _rerank(batch_size=batch, draft="model", draft_tokens=dk)
                out[f"ar+{who}-draft/{gtag}/{tag}"] = Case("ar", None, rr, g, n, drafter=who)
            for tau in (0.9, 0.75):  # operating-point candidates, SID threshold as served
                out[f"dm{tau}/sid/{gtag}/{tag}"] = Case("dm", tau, _rerank(batch_size=batch, **served), g, n)
        out[f"ar/plain/nojump/{tag}"] = Case(
            "ar", None, _rerank(batch_size=batch, jump_forward=False), "plain", n
        )
    for tau in (1.0, 0.9, 0.75, 0.6, 0.4):  # the benchmark's sweep and the candidates, with and without SIDs
        for g in (None, "plain"):
            gtag = g or "free"
            out[f"dm{tau}/{gtag}"] = Case("dm", tau, _rerank(), g)
            out[f"dm{tau}/sid/{gtag}"] = Case("dm", tau, _rerank(**served), g)
    for g in (None, "plain"):
        gtag = g or "free"
        out[f"dm0.75/sid-list/{gtag}"] = Case("dm", 0.75, _rerank(sid_scope="list", **served), g)
        out[f"dm0.75/sid/window4/{gtag}"] = Case("dm", 0.75, _rerank(**served), g, window=4)
        out[f"dm0.75/sid/separate/{gtag}"] = Case("dm", 0.75, _rerank(**served), g, extra=(("fused", False),))
        out[f"dm0.75/sid/copy/{gtag}"] = Case("dm", 0.75, _rerank(copy_drafts=True, **served), g)
        out[f"dm0.9/copy/{gtag}"] = Case("dm", 0.9, _rerank(copy_drafts=True), g)
        out[f"dm0.75/sid/steps2/{gtag}"] = Case("dm", 0.75, _rerank(max_steps_per_block=2, **served), g)
        out[f"dm0.75/sid/eager/{gtag}"] = Case("dm", 0.75, _rerank(backend="eager", **served), g)
        out[f"ar/eager/{gtag}"] = Case("ar", None, _rerank(backend="eager"), g)
        # rollouts (RL, OPD): sampled at temperature 1, 64 rows a batch (here one batch)
        out[f"ar/rollout/{gtag}"] = Case("ar", None, _rerank(), g, sample_seed=3)
        out[f"dm0.9/rollout/{gtag}"] = Case("dm", 0.9, _rerank(), g, sample_seed=3)
        out[f"dm0.9/sid/rollout/{gtag}"] = Case("dm", 0.9, _rerank(**served), g, sample_seed=4)
    # the served SID codes are rarely the confident choices of these models: even ids stand in for
    # them, so that the SID gate (everywhere, and after the list key) changes what is committed
    standin = (("sid_token_ids", STAND_IN_SIDS),)
    for g in (None, "plain"):
        gtag = g or "free"
        out[f"dm0.75/sid-standin/{gtag}"] = Case("dm", 0.75, _rerank(**served), g, extra=standin)
        out[f"dm0.4/sid-standin/{gtag}"] = Case("dm", 0.4, _rerank(**served), g, extra=standin)
        rr = _rerank(sid_scope="list", **served)
        out[f"dm0.75/sid-standin-list/{gtag}"] = Case("dm", 0.75, rr, g, extra=standin)
        out[f"dm0.9/sid-standin/rollout/{gtag}"] = Case(
            "dm", 0.9, _rerank(**served), g, sample_seed=5, extra=standin
        )
    out["dm0.75/sid/cited"] = Case("dm", 0.75, _rerank(**served, cite_prompt_sids=True), "cited")
    out["ar/cited"] = Case("ar", None, _rerank(cite_prompt_sids=True), "cited")
    out["dm0.75/sid/separate/window4/plain"] = Case(
        "dm", 0.75, _rerank(**served), "plain", window=4, extra=(("fused", False),)
    )
    for rule in ("confident",):  # the paper's rule (benchmark --params), free only
        out[f"dm0.75/{rule}/free"] = Case("dm", 0.75, _rerank(commit_rule=rule), None)
        out[f"dm0.75/{rule}/sid/free"] = Case("dm", 0.75, _rerank(commit_rule=rule, **served), None)
    # the debugging runner (no cache): the same tokens as the cached one
    out["dm0.75/sid/recompute/plain"] = Case(
        "dm", 0.75, _rerank(**served), "plain", extra=(("recompute", True),)
    )
    out["ar+pld3/recompute/plain"] = Case(
        "ar", None, _rerank(draft="prompt", draft_tokens=3), "plain", extra=(("recompute", True),)
    )
    return out


@dataclass
class World:
    tokenizer: PreTrainedTokenizerFast
    requests: pd.DataFrame
    models: dict[str, PreTrainedModel]


EXPLANATION = "The user watches dramas, so drama comes first."
STEPS = 60  # AdamW steps of each model: templates learnt, SIDs half (a mix of sure and unsure)
STAND_IN_SIDS = frozenset(range(0, 1024, 2))
DM_HEAD_SCALE = 3.0  # the trained diffusion model's LM head, scaled after training (or loading)
CONTEXT = 64  # prompt tokens trained on (RoPE is relative; a full prompt costs 8x the time)


def _answers(tokenizer: PreTrainedTokenizerFast, requests: pd.DataFrame) -> list[list[int]]:
    """Each request's answer as the teacher writes it: the target first, then the pre-rank order."""
    out = []
    for row in requests.itertuples(index=False):
        sids = list(row.candidate_sids)
        first = sids[row.target_position - 1]
        text = render_answer(EXPLANATION, [first, *(s for s in sids if s != first)]) + IM_END
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def _trained(
    model: PreTrainedModel, prompts: list[list[int]], answers: list[list[int]], mask_id: int | None
) -> None:
    """`STEPS` steps of next-token loss on `[prompt | answer]` (right-padded, causal); with `mask_id`
    each answer's inputs are masked at a random rate per row, so masked canvases get confident
    predictions (a stand-in for CFT). Seeded; one thread (set by the caller): the same weights every run."""
    prompts = [p[-CONTEXT:] for p in prompts]  # the candidates' SIDs sit at the prompt's end
    seqs = [[*p, *a] for p, a in zip(prompts, answers, strict=True)]
    width = max(map(len, seqs))
    ids = torch.tensor([[*s, *[0] * (width - len(s))] for s in seqs])  # [b, l]
    labels = torch.full_like(ids, -100)
    for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
    attention = (torch.arange(width)[None] < torch.tensor([len(s) for s in seqs])[:, None]).long()
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(STEPS):
        inputs = ids
        if mask_id is not None:
            rate = torch.rand(ids.shape[0], 1, generator=gen)  # [b, 1]
            hit = (torch.rand(ids.shape, generator=gen) < rate) & (labels != -100)
            inputs = ids.masked_fill(hit, mask_id)
        loss = model(input_ids=inputs, attention_mask=attention, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def world(weights: Path | None = WEIGHTS) -> World:
    """The synthetic world (16 users) and the seeded models, trained or read from `weights`."""
    tokenizer, requests = make_world(n_users=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ar = tiny_model_for(tokenizer, num_layers=2)
        torch.manual_seed(1)
        dm = tiny_model_for(tokenizer, block_size=BLOCK, num_layers=2)
        twin = tiny_model_for(tokenizer, num_layers=2)
    if weights is not None and weights.exists():
        state = load_file(weights)
        for name, model in (("ar", ar), ("dm", dm)):
            model.load_state_dict(
                {k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(name + ".")}
            )
    else:
        prompts = [list(p) for p in requests["prompt_ids"]]
        answers = _answers(tokenizer, requests)
        _trained(ar, prompts, answers, None)
        _trained(dm, prompts, answers, tokenizer.mask_token_id)
    with torch.no_grad():  # sharper canvases: parallel commits at the served taus too
        dm.lm_head.weight.mul_(DM_HEAD_SCALE)
    twin.load_state_dict(ar.state_dict())  # the AR model's weights as a block-4 drafter
    twin.config.block_size, twin.config.mask_token_id = 4, tokenizer.mask_token_id
    return World(tokenizer, requests, {"ar": ar.eval(), "dm": dm.eval(), "twin": twin.eval()})


def save_weights(w: World, path: Path) -> None:
    state = {
        f"{name}.{k}": v.contiguous() for name in ("ar", "dm") for k, v in w.models[name].state_dict().items()
    }
    save_file(state, path)


def config_of(w: World, case: Case) -> DecodeConfig:
    """The case's `DecodeConfig`, as the pipelines build it."""
    sampling: dict[str, Any] = {}
    if case.sample_seed is not None:
        sampling = {"do_sample": True, "temperature": 1.0, "seed": case.sample_seed}
    cfg = decode_config_for(
        w.models[case.model], w.tokenizer, case.tau, case.rerank, window=case.window, **sampling
    )
    return dataclasses.replace(cfg, **dict(case.extra))


def run(w: World, case: Case) -> list[DecodeOutput]:
    rows = w.requests.iloc[: case.n]
    prompts = [list(p) for p in rows["prompt_ids"]]
    grammars = None if case.grammar is None else request_grammars(w.tokenizer, rows, case.grammar == "cited")
    drafter = None if case.drafter is None else w.models[case.drafter]
    return decode(w.models[case.model], prompts, config_of(w, case), grammars, drafter=drafter)


def record(outputs: list[DecodeOutput]) -> list[dict[str, Any]]:
    return [
        {
            "tokens": o.tokens,
            "steps": o.commit_steps,
            "nfe": o.nfe,
            "forced": o.forced,
            "tail_tokens": o.tail_tokens,
            "tail_steps": o.tail_steps,
            "logps": [round(x, 8) for x in o.token_logprobs],
        }
        for o in outputs
    ]


def dump(w: World, progress: Callable[[str], object] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every case's record, by name."""
    out = {}
    for name, case in cases().items():
        out[name] = record(run(w, case))
        if progress is not None:
            progress(name)
    return out


UNIT_ROUNDOFF = 2.0**-24  # float32: a sum's each rounding is off by at most this share of its value


def summation_depth(model: PreTrainedModel, max_len: int) -> int:
    """How many terms the float32 sums behind one log-prob add up, along the longest chain: per layer
    the q/k/v projections (hidden), the scores (head_dim), softmax and the weighted values (one term per
    position), the output projection (heads x head_dim) and the MLP (hidden, then intermediate); then
    the LM head (hidden) and the log-sum-exp over the vocabulary."""
    c = model.config
    per_layer = (
        2 * c.hidden_size
        + c.head_dim
        + 2 * max_len
        + c.num_attention_heads * c.head_dim
        + c.intermediate_size
    )
    return c.num_hidden_layers * per_layer + c.hidden_size + c.vocab_size


def logit_bound(model: PreTrainedModel) -> float:
    """An upper bound on any |logit|: the final RMSNorm's output has norm <= sqrt(hidden) x its largest
    gain, and a logit is its dot product with one LM-head row (Cauchy-Schwarz)."""
    gain = model.model.norm.weight.abs().max().item()
    rows = model.lm_head.weight.norm(dim=1).max().item()
    return rows * gain * model.config.hidden_size**0.5


def logprob_tolerance(models: Iterator[PreTrainedModel] | list[PreTrainedModel], max_len: int) -> float:
    """How far a recorded log-prob may move when only the order of float32 sums changes.

    Another CPU (AVX-512 vs AVX2 vs the generic kernels), another MKL path or another thread count
    adds the same terms in another order. Each reordered sum of n terms moves by about sqrt(n) x u x
    (the sum of the terms' sizes): rounding errors add like a random walk (Higham, "Accuracy and
    Stability of Numerical Algorithms", 2nd ed., ch. 2.8, 4.2); the worst case is n x u. Along the
    chain of `summation_depth` terms, the sizes are those of the logits, at most `logit_bound`. A
    log-prob z_i - logsumexp(z) moves by at most twice its logits' largest move. So:

        tolerance = 2 x sqrt(depth) x u x max |logit|

    For the golden models (depth 3,168; |logit| <= 19.6) that is 1.3e-4. Measured on an AMD EPYC
    against the dump recorded there (`ATEN_CPU_CAPABILITY=default` or `avx2`, `MKL_CBWR=COMPATIBLE`, 1, 2
    or 4 threads): at most 5.7e-6, with every token, step and forward identical. A real change moves
    log-probs by far more: a 0.1% change of the LM head moves them by ~2e-3 (`test_golden.py` plants it).
    """
    return max(2 * summation_depth(m, max_len) ** 0.5 * UNIT_ROUNDOFF * logit_bound(m) for m in models)


def tolerance_of(w: World) -> float:
    """`logprob_tolerance` for the world's models at the longest prompt plus the answer budget."""
    longest = max(len(p) for p in w.requests["prompt_ids"]) + MAX_NEW
    return logprob_tolerance(list(w.models.values()), longest)


def differences(got: dict[str, Any], want: dict[str, Any], atol: float) -> Iterator[str]:
    """Each way `got` departs from `want`: exact on everything but log-probs (to `atol`)."""
    if got.keys() != want.keys():
        yield f"cases differ: missing {sorted(want.keys() - got.keys())}, new {sorted(got.keys() - want.keys())}"
    for name in sorted(want.keys() & got.keys()):
        for i, (a, b) in enumerate(zip(got[name], want[name], strict=True)):
            for key in ("tokens", "steps", "nfe", "forced", "tail_tokens", "tail_steps"):
                if a[key] != b[key]:
                    yield f"{name} row {i}: {key} {a[key]} != {b[key]}"
            la, lb = a["logps"], b["logps"]
            if len(la) != len(lb) or any(abs(x - y) > atol for x, y in zip(la, lb, strict=False)):
                worst = max((abs(x - y) for x, y in zip(la, lb, strict=False)), default=float("nan"))
                yield f"{name} row {i}: log-probs differ by {worst:.2e}, beyond {atol:.2e}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--write", type=Path, help="write the dump here")
    what.add_argument("--check", type=Path, help="compare the dump with this file")
    parser.add_argument("--train", action="store_true", help=f"train the models afresh into {WEIGHTS.name}")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # recorded with one thread; `--check` passes under any count
    w = world(None if args.train else WEIGHTS)
    if args.train:
        save_weights(w, WEIGHTS)
    got = dump(w, lambda name: print(name, file=sys.stderr))
    if args.write:
        args.write.write_text(json.dumps(got, separators=(",", ":")) + "\n")
        print(f"{len(got)} cases written to {args.write}")
        return 0
    bad = list(differences(got, json.loads(args.check.read_text()), tolerance_of(w)))
    print("\n".join(bad[:50]) or f"{len(got)} cases identical")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
