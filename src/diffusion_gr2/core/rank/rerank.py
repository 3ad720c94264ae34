"""Re-ranking with a trained model, and the evaluation of the rankings it produces (docs/evaluation.md).

`rerank` decodes every request with the one decoder, parses each answer against the request's
candidate SIDs and maps the SIDs back to item ids; an invalid answer is served the pre-rank order and
counted (docs/architecture.md#items-candidates-and-prompts). With `RerankConfig.constrained` (the default)
decoding follows each request's answer grammar (`decode/grammar.py`), so every answer is a valid ranking;
`forced` counts the corrections. `unforced` marks the requests where the model's own answer (unconstrained
greedy decoding) is one the grammar accepts, and `unforced_ranking` holds that answer's ranking: for AR,
and without jump-forward, that is the served answer with `forced == 0` (token for token the free
one); a diffusion system with jump-forward (the default) writes forced tokens the model never chose,
so its own answer comes from a second, free pass (`own_answers`). `unforced_rate` in the metrics is
the model's own valid-output rate, the method's claim; `valid_rate` is the product's. Its rows are
the `rankings.parquet` contract: every number in `stage_metrics.json` is recomputable from them alone
(`stage_metrics`).

`tau` is the commit threshold of block diffusion; AR systems have none (NaN in the frame, null in
JSON) and decode with block size 1 whatever their config says.

Two systems answer without a model (`NO_MODEL_SYSTEMS`): the pre-rank (`prerank_rows`, the
retriever's order, the floor) and the learned analyst (`analyst_rows`, its noiseless order over the
evidence, the teacher's ceiling); their rows are valid, with no tokens and no forwards.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from diffusion_gr2.core.decode.decoder import DecodeConfig, DecodeOutput, decode
from diffusion_gr2.core.decode.grammar import AnswerGrammar, accepts, answer_grammars
from diffusion_gr2.core.decode.grammar_tokens import list_key_ids, sid_token_ids
from diffusion_gr2.core.evaluate.metrics import own_valid_flags, user_values
from diffusion_gr2.core.evaluate.tables import NO_MODEL_SYSTEMS
from diffusion_gr2.core.rank.operating_point import floor_screen
from diffusion_gr2.core.text.evidence import Evidence
from diffusion_gr2.core.text.parser import OK, apply_fallback, parse_answer
from diffusion_gr2.core.text.tokenizer import IM_END, decode_response

logger = logging.getLogger(__name__)

__all__ = [
    "AR_SYSTEMS",
    "DIFFUSION_SYSTEMS",
    "NO_MODEL_SYSTEMS",
    "RANKING_COLUMNS",
    "SERVED_DIFFUSION",
    "SYSTEMS",
    "RerankConfig",
    "analyst_order",
    "analyst_rows",
    "decode_config_for",
    "decode_requests",
    "prerank_rows",
    "prepare_model",
    "ranking_rows",
    "rerank",
    "rerank_system",
    "request_grammars",
    "request_histories",
    "resolve_device",
    "needs_own_pass",
    "own_answers",
    "own_validity",
    "pass_figures",
    "rerank_screened",
    "select_requests",
    "setting_rows",
]

# in report order (docs/architecture.md#names-and-report-files)
SYSTEMS = ("prerank", "analyst", "ar_sft", "ar_rl", "naive", "cft", "opd", "rl", "distilled")
AR_SYSTEMS = ("ar_sft", "ar_rl")
SID_SCOPES = ("answer", "list")  # where RerankConfig.sid_threshold holds
DIFFUSION_SYSTEMS = ("naive", "cft", "opd", "rl", "distilled")
# The diffusion system the registry's `diffusion-gr2` holds and `make serve` serves: the chain's last
# stage (rl distilled onto its own decoding trajectories: docs/experiments.md#trajectory-distillation).
SERVED_DIFFUSION = "distilled"
RANKING_COLUMNS = (
    "split",
    "system",
    "tau",
    "window",
    "user_id",
    "point",
    "target",
    "prerank",
    "ranking",
    "valid",
    "reason",
    "output_tokens",
    "nfe",
    "forced",
    "unforced",  # the model's own (free greedy) answer is one the grammar accepts
    "unforced_ranking",  # item ids of that answer (empty when not unforced)
    "output_text",
)


@dataclass(frozen=True)
class RerankConfig:
    """How the inference stage decodes; the model's config supplies block size and mask id."""

    # Defaults are conf/base's `inference.decoding` (tests/test_config.py holds them equal): what a
    # caller outside a Kedro run (a notebook, a script, a test) gets is what inference serves.
    max_new_tokens: int = 192  # teacher responses (reasoning + a 10-SID JSON answer): 107-142 tokens
    batch_size: int = 32  # rows decoded together
    max_steps_per_block: int | None = None  # None -> block size (the decoder's default cap)
    commit_rule: str = DecodeConfig.commit_rule  # diffusion systems: which positions a step commits
    constrained: bool = True  # decode under each request's answer grammar (every answer valid)
    device: str = "auto"  # "auto" = cuda when available, else cpu
    backend: str = DecodeConfig.backend  # the model forward: "auto", "lean" or "eager" (decoder.BACKENDS)
    jump_forward: bool = DecodeConfig.jump_forward  # constrained: write tokens the grammar forces at once
    # AR systems: drafts verified in one forward, lossless ("prompt" = prompt lookup; None = off).
    # Diffusion systems decode without them whatever this says (core/decode/drafters.py).
    draft: str | None = DecodeConfig.draft
    draft_tokens: int = DecodeConfig.draft_tokens  # draft tokens fed per forward at most
    # Diffusion systems: copy drafts (prompt-lookup continuations fed as tokens, committed where the
    # model agrees; not lossless, so chosen on validation: core/decode/drafters.py). AR: see `draft`.
    copy_drafts: bool = DecodeConfig.copy_drafts
    # Under the grammar: the explanation may cite only the prompt's SIDs, whole; the rest of a SID
    # its first tokens pin is then forced (jump-forward writes it). Stricter, so own validity can
    # only fall: chosen on validation (grammar.py; docs/experiments.md#cited-sids).
    cite_prompt_sids: bool = False
    # Diffusion systems: the tau a SID code must clear to be committed beside others in a forward
    # (None = tau everywhere). Free answers break at SID codes, not in the explanation
    # (DecodeConfig.sid_threshold); chosen on validation. Rollouts pass their own (RolloutConfig).
    sid_threshold: float | None = 0.99
    # Where the SID threshold holds: "answer" (every SID code) or "list" (the ranking list only: the
    # explanation's cited SIDs keep tau; DecodeConfig.sid_after).
    sid_scope: str = "answer"
    # Diffusion systems: a token equal to its left neighbour's, both chosen in one forward, is not
    # committed beside it (DecodeConfig.repeat_gate).
    repeat_gate: bool = True
    # The static decode step (core/decode/static.py: fixed shapes, the same tokens; slower on the CPU)
    # and, with it on CUDA, its steps captured as CUDA graphs and replayed. Off: unmeasured on a GPU.
    static_cache: bool = DecodeConfig.static_cache
    cuda_graphs: bool = DecodeConfig.cuda_graphs


def resolve_device(name: str) -> torch.device:
    """`"auto"` -> cuda when available, else cpu; anything else is passed to `torch.device`."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def prepare_model(model: PreTrainedModel, device: str) -> PreTrainedModel:
    """The model on `device`, in eval mode (the decoder runs wherever the model's weights are)."""
    return model.to(resolve_device(device)).eval()


def _eos_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """End-of-output ids: the tokenizer's eos and `<|im_end|>` (the same token in our tokenizers)."""
    ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)}
    return tuple(sorted(i for i in ids if i is not None and i != tokenizer.unk_token_id))


def decode_config_for(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tau: float | None,
    config: RerankConfig,
    *,
    window: int | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    seed: int = 0,
) -> DecodeConfig:
    """The one `DecodeConfig` builder: inference, the benchmark, serving and RL/OPD rollouts.

    Block size and mask id come from the model's config, eos/pad from the tokenizer, the rest from
    `config`; rollouts add sampling (`do_sample`, `temperature`, `seed`). `tau=None` means an AR
    system: block size 1. Otherwise the model must be a converted block-diffusion model
    (`config.block_size`, set by conversion).
    """
    block_size, mask_id, threshold = 1, None, DecodeConfig.threshold
    if tau is not None:
        block_size = getattr(model.config, "block_size", None)
        if block_size is None:
            raise ValueError("tau given but the model has no config.block_size: not a block-diffusion model")
        mask_id = getattr(model.config, "mask_token_id", None)
        if mask_id is None:
            raise ValueError("a block-diffusion model needs config.mask_token_id (set by conversion)")
        threshold = float(tau)
    if config.sid_scope not in SID_SCOPES:
        raise ValueError(f"sid_scope {config.sid_scope!r}: expected one of {SID_SCOPES}")
    sid_gated = block_size > 1 and config.sid_threshold is not None
    return DecodeConfig(
        block_size=int(block_size),
        threshold=threshold,
        max_new_tokens=config.max_new_tokens,
        max_steps_per_block=config.max_steps_per_block,
        commit_rule=config.commit_rule,
        eos_token_ids=_eos_ids(tokenizer),
        mask_token_id=mask_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        batch_size=config.batch_size,
        window=window if block_size > 1 else None,
        do_sample=do_sample,
        temperature=temperature,
        seed=seed,
        backend=config.backend,
        jump_forward=config.jump_forward,
        draft=config.draft if block_size == 1 else None,
        copy_drafts=config.copy_drafts and block_size > 1,
        draft_tokens=config.draft_tokens,
        sid_threshold=config.sid_threshold if block_size > 1 else None,
        sid_token_ids=sid_token_ids(tokenizer) if sid_gated else frozenset(),
        sid_after=list_key_ids(tokenizer) if sid_gated and config.sid_scope == "list" else (),
        repeat_gate=config.repeat_gate and block_size > 1,
        static_cache=config.static_cache,
        cuda_graphs=config.cuda_graphs,
    )


def select_requests(
    requests: pd.DataFrame, split: str = "test", max_requests: int | None = None
) -> pd.DataFrame:
    """Rows of `split` by point, then user id; the first `max_requests` of them when capped.

    Point-major order makes every prefix deterministic and spread over as many users as it can:
    the first U requests are point 0 of every user, i.e. the leave-one-out test set.
    """
    rows = requests[requests["split"] == split].sort_values(["point", "user_id"], kind="stable")
    if max_requests is not None:
        rows = rows.head(int(max_requests))
    return rows.reset_index(drop=True)


def request_grammars(
    tokenizer: PreTrainedTokenizerBase, requests: pd.DataFrame, cite_prompt_sids: bool = False
) -> list[AnswerGrammar]:
    """The answer grammar of each request: its candidate SIDs, ended by `<|im_end|>`; with
    `cite_prompt_sids` its explanation cites only SIDs of its prompt (`RerankConfig`)."""
    prompts = [list(p) for p in requests["prompt_ids"]] if cite_prompt_sids else None
    sids = [[str(s) for s in c] for c in requests["candidate_sids"]]
    return answer_grammars(tokenizer, sids, IM_END, prompts)


def decode_requests(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    config: DecodeConfig,
    desc: str = "decode",
    grammars: Sequence[AnswerGrammar] | None = None,
) -> list[DecodeOutput]:
    """`decode` (which batches `config.batch_size` at a time, longest prompts first) with a progress bar.

    Outputs come back in the order of `prompts`; greedy results do not depend on the batching.
    `grammars`, one per prompt, constrain each answer (copied, never advanced).
    """
    with tqdm(total=len(prompts), desc=desc, unit="req", leave=False) as bar:
        return decode(model, prompts, config, grammars, progress=bar.update)


def _tau_value(tau: float | None) -> float:
    """The frame's tau: NaN for AR systems (no threshold)."""
    return float("nan") if tau is None else float(tau)


def ranking_rows(
    requests: pd.DataFrame,
    outputs: Sequence[DecodeOutput],
    tokenizer: PreTrainedTokenizerBase,
    system: str,
    tau: float | None,
    window: int | None = None,
    split: str = "test",
    own: Sequence[tuple[bool, list[str]]] | None = None,
) -> pd.DataFrame:
    """Parse each output against its request's candidate SIDs; rows in `RANKING_COLUMNS` order.

    A valid answer's SIDs are mapped back to item ids; an invalid one is served the pre-rank order
    (docs/architecture.md#items-candidates-and-prompts) and keeps its parser reason. `own` (from
    `own_answers`): per request, whether the model's own answer is grammar-accepted and its SIDs; None = the
    served answer with `forced == 0`.
    """
    if len(requests) != len(outputs) or (own is not None and len(own) != len(outputs)):
        raise ValueError(f"{len(requests)} requests but {len(outputs)} outputs")
    rows = []
    for n, (req, out) in enumerate(zip(requests.itertuples(index=False), outputs, strict=True)):
        sids, items = [str(s) for s in req.candidate_sids], [int(i) for i in req.candidates]
        text = decode_response(tokenizer, out.tokens)
        parsed = parse_answer(text, sids)
        item_of = dict(zip(sids, items, strict=True))
        unforced, own_sids = own[n] if own is not None else (parsed.valid and out.forced == 0, parsed.ranking)
        rows.append(
            {
                "split": split,
                "system": system,
                "tau": _tau_value(tau),
                "window": _tau_value(window),
                "user_id": int(req.user_id),
                "point": int(req.point),
                "target": int(req.target),
                "prerank": items,
                "ranking": [item_of[s] for s in apply_fallback(parsed, sids)],
                "valid": parsed.valid,
                "reason": parsed.reason,
                "output_tokens": len(out.tokens),
                "nfe": int(out.nfe),
                "forced": int(out.forced),
                "unforced": bool(unforced),
                "unforced_ranking": [item_of[s] for s in own_sids] if unforced else [],
                "output_text": text,
            }
        )
    return pd.DataFrame(rows, columns=list(RANKING_COLUMNS))


def needs_own_pass(config: DecodeConfig, grammars: Sequence[AnswerGrammar] | None) -> bool:
    """Whether served answers can differ from the model's own without a correction being counted:
    diffusion under a grammar with jump-forward (AR jump-forward is exact, see core/decode/steps.py)."""
    return grammars is not None and config.block_size > 1 and config.jump_forward


def own_answers(
    outputs: Sequence[DecodeOutput],
    candidate_sids: Sequence[Sequence[str]],
    tokenizer: PreTrainedTokenizerBase,
    grammars: Sequence[AnswerGrammar],
    max_new_tokens: int,
) -> list[tuple[bool, list[str]]]:
    """Per free (unconstrained) output: whether its request's grammar accepts it, and its SIDs."""
    own = []
    for out, grammar, sids in zip(outputs, grammars, candidate_sids, strict=True):
        parsed = parse_answer(decode_response(tokenizer, out.tokens), [str(s) for s in sids])
        ok = parsed.valid and accepts(grammar, out.tokens, max_new_tokens)
        own.append((ok, list(parsed.ranking) if ok else []))
    return own


def own_validity(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    served: Sequence[DecodeOutput],
    candidate_sids: Sequence[Sequence[str]],
    tokenizer: PreTrainedTokenizerBase,
    config: DecodeConfig,
    grammars: Sequence[AnswerGrammar] | None,
    desc: str = "decode",
) -> list[tuple[bool, list[str]]]:
    """The model's own answers (the one definition of `unforced`, wherever it is reported).

    Own answer = greedy decoding with no grammar; it is valid when its request's grammar accepts it.
    Where the served pass cannot differ from the free one without a counted correction (AR, no
    grammar, no jump-forward) the served outputs are read (`forced == 0`: token for token the free
    pass, `test_ar_jump_forward_is_exact`); otherwise a second, free pass decodes them.
    """
    if needs_own_pass(config, grammars):
        assert grammars is not None
        free = decode_requests(model, prompts, config, desc=f"{desc} (free)")
        return own_answers(free, candidate_sids, tokenizer, grammars, config.max_new_tokens)
    own = []
    for out, sids in zip(served, candidate_sids, strict=True):
        parsed = parse_answer(decode_response(tokenizer, out.tokens), [str(s) for s in sids])
        ok = parsed.valid and out.forced == 0
        own.append((ok, list(parsed.ranking) if ok else []))
    return own


def rerank(
    model: PreTrainedModel,
    requests: pd.DataFrame,
    tokenizer: PreTrainedTokenizerBase,
    config: DecodeConfig,
    system: str,
    tau: float | None,
    grammars: Sequence[AnswerGrammar] | None = None,
    split: str = "test",
) -> pd.DataFrame:
    """Re-rank every request with `model`: one `RANKING_COLUMNS` row per request, in request order.

    `grammars` (`request_grammars(tokenizer, requests)`) constrain each answer; never mutated. The
    frame's `attrs["decode_s"]` is the wall time of the decoding (the operating point's speed figure).
    """
    label = system if tau is None else f"{system} tau={tau}"
    if config.window is not None:
        label += f" window={config.window}"
    prompts = list(requests["prompt_ids"])
    start = time.perf_counter()
    outputs = decode_requests(model, prompts, config, desc=f"{split} {label}", grammars=grammars)
    elapsed = time.perf_counter() - start
    sids = [[str(s) for s in c] for c in requests["candidate_sids"]]  # the free pass is not timed
    own = own_validity(model, prompts, outputs, sids, tokenizer, config, grammars, f"{split} {label}")
    rows = ranking_rows(requests, outputs, tokenizer, system, tau, config.window, split, own)
    rows.attrs["decode_s"] = elapsed
    unforced = own_valid_flags(rows)
    logger.info(
        "%s: %d requests, valid %.1f%% (own answers %.1f%%), %.1f output tokens "
        "and %.1f forwards per request",
        label,
        len(rows),
        100.0 * rows["valid"].mean() if len(rows) else float("nan"),
        100.0 * unforced.mean() if len(rows) else float("nan"),
        rows["output_tokens"].mean(),
        rows["nfe"].mean(),
    )
    return rows


def rerank_system(
    model: PreTrainedModel,
    requests: pd.DataFrame,
    tokenizer: PreTrainedTokenizerBase,
    system: str,
    settings: Sequence[tuple[float | None, int | None]],
    config: RerankConfig,
    split: str = "test",
) -> tuple[pd.DataFrame, list[dict[str, Any]]]:
    """All rows of one system on one split, one pass per (tau, window) setting, and each pass's speed.

    An AR system decodes once (no tau, no window) whatever `settings` holds. The speed rows
    (`pass_figures`) hold `tau`, `window`, `split`, `n`, `decode_s`, `tokens_per_s` (output tokens
    over the pass's wall time), `tokens_per_forward`, `recall@1` and `unforced_rate`.
    """
    grid = [(None, None)] if system in AR_SYSTEMS else [(float(t), w) for t, w in settings]
    # Built once (a large vocabulary takes a while to tabulate); decoding only ever advances copies.
    grammars = request_grammars(tokenizer, requests, config.cite_prompt_sids) if config.constrained else None
    frames, speeds = [], []
    for tau, window in grid:
        cfg = decode_config_for(model, tokenizer, tau, config, window=window)
        rows = rerank(model, requests, tokenizer, cfg, system, tau, grammars, split)
        speeds.append(pass_figures(rows, tau, window, split, rows.attrs["decode_s"]))
        frames.append(rows)
    return pd.concat(frames, ignore_index=True), speeds


def pass_figures(
    rows: pd.DataFrame, tau: float | None, window: int | None, split: str, decode_s: float
) -> dict[str, Any]:
    """The speed row of one pass (`rows`, decoded in `decode_s` seconds of wall time)."""
    return {
        "tau": tau,
        "window": window,
        "split": split,
        "n": len(rows),
        "decode_s": float(decode_s),
        "tokens_per_s": float(rows["output_tokens"].sum()) / max(decode_s, 1e-9),
        "tokens_per_forward": float(rows["output_tokens"].sum()) / max(int(rows["nfe"].sum()), 1),
        "recall@1": float(user_values(rows)["recall@1"].mean()) if len(rows) else float("nan"),
        "unforced_rate": float(own_valid_flags(rows).mean()) if len(rows) else float("nan"),
    }


def setting_rows(rows: pd.DataFrame, tau: float | None, window: int | None) -> pd.DataFrame:
    """The rows of one (tau, window) pass of a system's frame (NaN tau: AR; NaN window: whole block)."""
    same_tau = rows["tau"].isna() if tau is None else rows["tau"] == tau
    same_window = rows["window"].isna() if window is None else rows["window"] == window
    return rows[same_tau & same_window]


def rerank_screened(
    model: PreTrainedModel,
    requests: pd.DataFrame,
    tokenizer: PreTrainedTokenizerBase,
    system: str,
    settings: Sequence[tuple[float | None, int | None]],
    config: RerankConfig,
    floor: float,
    screen_requests: int,
    z: float,
    split: str = "valid",
) -> tuple[pd.DataFrame, list[dict[str, Any]]]:
    """`rerank_system` for candidates that must keep an own valid rate of `floor`, screened first.

    Every setting decodes the first `screen_requests`; one whose `floor_screen` fails there stops
    (its rows and figures are those requests', `floor_screen` records why), the others decode the
    rest, and their rows and figures are `rerank_system`'s over every request (greedy decoding does
    not depend on the batching). Each speed row carries its `floor_screen`.
    """
    n = int(screen_requests)
    head_rows, head = rerank_system(model, requests.head(n), tokenizer, system, settings, config, split)
    screens = [floor_screen(s["unforced_rate"], s["n"], floor, z) for s in head]
    if len(requests) <= n:  # the screen saw every request: nothing left to spare
        return head_rows, [s | {"floor_screen": screen} for s, screen in zip(head, screens, strict=True)]
    for s, screen in zip(head, screens, strict=True):
        if not screen["passed"]:
            logger.info(
                "%s tau %s, window %s: own valid %.2f on the first %d %s requests (upper bound %.2f < "
                "the floor %.2f): refused on the floor, the other %d requests not decoded",
                system, s["tau"], s["window"], s["unforced_rate"], n, split, screen["own_valid_upper"],
                floor, len(requests) - n,
            )  # fmt: skip
    kept = [(s["tau"], s["window"]) for s, screen in zip(head, screens, strict=True) if screen["passed"]]
    rest_rows, rest = (
        rerank_system(model, requests.iloc[n:], tokenizer, system, kept, config, split)
        if kept
        else (None, [])
    )
    rest_s = {(r["tau"], r["window"]): r["decode_s"] for r in rest}
    frames, speeds = [], []
    for s, screen in zip(head, screens, strict=True):
        key = (s["tau"], s["window"])
        rows = setting_rows(head_rows, *key)
        if key in rest_s:
            rows = pd.concat([rows, setting_rows(rest_rows, *key)], ignore_index=True)
            s = pass_figures(rows, *key, split, s["decode_s"] + rest_s[key])
        frames.append(rows)
        speeds.append(s | {"floor_screen": screen})
    return pd.concat(frames, ignore_index=True), speeds


def _unmodelled_rows(
    requests: pd.DataFrame, split: str, system: str, rankings: Sequence[Sequence[int]]
) -> pd.DataFrame:
    """Rows of a system no model answers (`NO_MODEL_SYSTEMS`): `rankings` served as they are, valid
    and its own answer, with no tokens and no forwards."""
    prerank = [[int(i) for i in c] for c in requests["candidates"]]
    return pd.DataFrame(
        {
            "split": split,
            "system": system,
            "tau": float("nan"),
            "window": float("nan"),
            "user_id": requests["user_id"].astype("int64").to_numpy(),
            "point": requests["point"].astype("int64").to_numpy(),
            "target": requests["target"].astype("int64").to_numpy(),
            "prerank": prerank,
            "ranking": [[int(i) for i in r] for r in rankings],
            "valid": True,
            "reason": OK,
            "output_tokens": 0,
            "nfe": 0,
            "forced": 0,
            "unforced": True,
            "unforced_ranking": [[int(i) for i in r] for r in rankings],
            "output_text": "",
        },
        columns=list(RANKING_COLUMNS),
    )


def prerank_rows(requests: pd.DataFrame, split: str = "test") -> pd.DataFrame:
    """The `prerank` system: the retriever's order served as is (valid, no tokens, no forwards)."""
    return _unmodelled_rows(requests, split, "prerank", list(requests["candidates"]))


def request_histories(requests: pd.DataFrame, candidates: pd.DataFrame, split: str) -> list[list[int]]:
    """Each request's history, from the `candidates` frame joined on (user_id, split, point); the
    requests' own `split` where they carry one, else `split`."""
    by_key = {
        (str(s), int(u), int(p)): [int(i) for i in h]
        for s, u, p, h in zip(
            candidates["split"],
            candidates["user_id"],
            candidates["point"],
            candidates["history"],
            strict=True,
        )
    }
    splits = requests["split"] if "split" in requests else [split] * len(requests)
    keys = [
        (str(s), int(u), int(p))
        for s, u, p in zip(splits, requests["user_id"], requests["point"], strict=True)
    ]
    missing = [k for k in keys if k not in by_key]
    if missing:
        raise ValueError(f"{len(missing)} requests have no row in the candidates frame, e.g. {missing[:3]}")
    return [by_key[k] for k in keys]


def analyst_order(
    evidence: Evidence, user_id: int, history: Sequence[int], candidates: Sequence[int]
) -> list[int]:
    """The candidates in the learned analyst's noiseless order (`Evidence.order`; its first pick is
    `learned_analyst.top_hits`' argmax)."""
    if evidence.ranker is None:
        raise ValueError("the analyst's rows need evidence with the learned analyst's ranker; none was fit")
    items = [int(i) for i in candidates]
    return [items[k] for k in evidence.order(evidence.table.raw(int(user_id), history, items))]


def analyst_rows(
    requests: pd.DataFrame, histories: pd.DataFrame, evidence: Evidence, split: str = "test"
) -> pd.DataFrame:
    """The `analyst` system: each request's candidates in the learned analyst's noiseless order (valid,
    no tokens, no forwards). Its R@1 is the teacher's ceiling: a model trained on the analyst's traces
    can at best learn what it knows (`trace_report.json` `analyst`, on the same requests).
    `histories`: the `candidates` frame (its `history` column; the requests frame has none)."""
    history = request_histories(requests, histories, split)
    rankings = [
        analyst_order(evidence, int(u), h, c)
        for u, h, c in zip(requests["user_id"], history, requests["candidates"], strict=True)
    ]
    return _unmodelled_rows(requests, split, "analyst", rankings)
