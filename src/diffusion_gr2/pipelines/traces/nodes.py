"""traces nodes: teacher traces by rejection sampling, the tokenizer, token-level datasets
(docs/architecture.md#items-candidates-and-prompts)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np
import pandas as pd
from transformers import PreTrainedTokenizerFast

from diffusion_gr2.core.data.schemas import validate_requests
from diffusion_gr2.core.evaluate.metrics import paired_bootstrap
from diffusion_gr2.core.evaluate.policy import Policy
from diffusion_gr2.core.model.factory import ModelSpec, load_pretrained_tokenizer
from diffusion_gr2.core.runs.mlflow_utils import as_metrics_history
from diffusion_gr2.core.text.evidence import (
    Evidence,
    EvidenceConfig,
    EvidenceTable,
    evidence_from_spec,
    evidence_spec,
    shows_evidence,
)
from diffusion_gr2.core.text.examples import encode_requests, encode_sft, length_report
from diffusion_gr2.core.text.learned_analyst import (
    LearnedAnalyst,
    LearnedAnalystConfig,
    fit_learned_analyst,
    top_hits,
)
from diffusion_gr2.core.text.prompt import ItemLookup, PromptConfig
from diffusion_gr2.core.text.tokenizer import build_tokenizer, extend_tokenizer, sid_tokens_from_sids
from diffusion_gr2.core.text.traces import (
    AnalystConfig,
    RerankExample,
    RuleBasedAnalyst,
    build_sft_rows,
    corpus_texts,
    examples_from_frame,
    popularity_from_histories,
    rejection_sample,
    sft_frame,
    sft_rows_from_frame,
)


def _lookup(items: pd.DataFrame, sids: pd.DataFrame, params: dict[str, Any]) -> ItemLookup:
    return ItemLookup.from_frames(items, sids, PromptConfig(**params["prompt"]))


def _evidence(
    candidates: pd.DataFrame, items: pd.DataFrame, splits: pd.DataFrame, params: dict[str, Any]
) -> Evidence:
    """The evidence: counts on the training sequences, levels cut at the quantiles of the training
    requests' candidates."""
    config = EvidenceConfig(**params.get("evidence", {}))
    table = EvidenceTable.from_frames(splits, items, config)
    train = candidates[candidates["split"] == "train"]
    return Evidence.fit(table, zip(train["user_id"], train["history"], train["candidates"], strict=True))


def analyst_ceiling(analyst: LearnedAnalyst, examples: list[RerankExample], level: float) -> dict[str, Any]:
    """Per split, the learned analyst's noiseless R@1 against the pre-rank's, paired at the policy's
    interval `level`: the teacher's ceiling (valid chooses its settings; test reports)."""
    out: dict[str, Any] = {}
    for split in ("valid", "test"):
        rows = [e for e in examples if e.split == split and e.target in e.candidates]
        if not rows:
            continue
        hits = top_hits(analyst, rows)
        prerank = np.array([float(e.candidates[0] == e.target) for e in rows])
        diff = paired_bootstrap(hits, prerank, level=level, groups=[e.user_id for e in rows])
        out[split] = {
            "n": len(rows),
            "analyst_recall@1": float(hits.mean()),
            "prerank_recall@1": float(prerank.mean()),
            "diff": diff.mean_diff,
            "diff_ci": [diff.low, diff.high],
        }
    return out


def generate_traces(
    candidates: pd.DataFrame,
    items: pd.DataFrame,
    sids: pd.DataFrame,
    splits: pd.DataFrame,
    params: dict[str, Any],
    policy: dict[str, Any],
) -> tuple[pd.DataFrame, dict[str, Any], dict[str, Any]]:
    """Teacher traces for the training rows, kept where the answer ranks the target within
    `keep_within`: the learned analyst's where the prompt shows evidence (`traces.evidence.in_prompt`
    or `hint`), the rule-based analyst's otherwise. The learned analyst is fit either way: its ceiling
    is in the report. Also the evidence's spec (`evidence.json`: settings, cuts and the analyst's
    ranker), which every prompt builder reads."""
    prompt_config = PromptConfig(**params["prompt"])
    lookup = _lookup(items, sids, params)
    evidence = _evidence(candidates, items, splits, params)
    examples = examples_from_frame(candidates)
    config = LearnedAnalystConfig(**params.get("learned_analyst", {}))
    train, valid = ([e for e in examples if e.split == s] for s in ("train", "valid"))
    learned, by_c = fit_learned_analyst(evidence, lookup, train, valid, config, prompt_config)
    evidence = learned.evidence  # with its ranker: the hint's
    report = {
        "analyst": {
            "C": min(by_c, key=lambda c: (-by_c[c], c)),
            "valid_recall@1_by_C": {str(c): r for c, r in by_c.items()},
            **analyst_ceiling(learned, examples, Policy.from_params(policy).level),
            "evidence_cuts": evidence.scale.to_dict(),
        }
    }
    teacher: LearnedAnalyst | RuleBasedAnalyst = learned
    if not evidence.table.config.shown:
        popularity = popularity_from_histories(splits["train_items"])  # training data only: no leakage
        teacher = RuleBasedAnalyst(lookup, popularity, AnalystConfig(**params["analyst"]), prompt_config)
    rows, stats = rejection_sample(teacher, train, params["max_tries"], params["seed"], params["keep_within"])
    shown = evidence if evidence.table.config.shown else None
    sft = sft_frame(build_sft_rows(rows, lookup, prompt_config, shown))
    return sft, asdict(stats) | report, evidence_spec(evidence)


def train_tokenizer(
    traces: pd.DataFrame, sids: pd.DataFrame, params: dict[str, Any], model_params: dict[str, Any]
) -> PreTrainedTokenizerFast:
    """The tokenizer of every later stage, with SID tokens, [MASK] and chat specials.

    A model built from a config gets a byte-level BPE trained on the project's own text; a pretrained
    one (`teacher_sft.model.kind` pretrained or gguf) keeps its own tokenizer, extended.
    """
    sid_tokens = sid_tokens_from_sids(sids["sid"])
    spec = ModelSpec(**model_params)
    if spec.kind != "config":
        return extend_tokenizer(load_pretrained_tokenizer(spec), sid_tokens)
    corpus = corpus_texts(sft_rows_from_frame(traces))
    return build_tokenizer(corpus, sid_tokens, vocab_size=params["vocab_size"])


def encode_datasets(
    traces: pd.DataFrame,
    candidates: pd.DataFrame,
    items: pd.DataFrame,
    sids: pd.DataFrame,
    tokenizer: PreTrainedTokenizerFast,
    trace_stats: dict[str, Any],
    evidence: dict[str, Any],
    splits: pd.DataFrame,
    params: dict[str, Any],
) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any], dict[str, Any]]:
    """Token ids of the SFT examples and of every re-ranking request, with the trace report."""
    sft_examples = encode_sft(sft_rows_from_frame(traces), tokenizer)
    requests = encode_requests(
        candidates,
        _lookup(items, sids, params),
        tokenizer,
        PromptConfig(**params["prompt"]),
        evidence_from_spec(evidence, splits, items) if shows_evidence(evidence) else None,
    )
    validate_requests(requests)  # every model stage reads it: a bad SID list stops here, named
    report = {**trace_stats, **length_report(sft_examples, requests), "vocab_size": len(tokenizer)}
    return sft_examples, requests, report, as_metrics_history(report)
