"""traces nodes: teacher traces by rejection sampling, the tokenizer, token-level datasets (DESIGN §4)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pandas as pd
from transformers import PreTrainedTokenizerFast

from diffusion_gr2.core.data.schemas import validate_requests
from diffusion_gr2.core.model.factory import ModelSpec, load_pretrained_tokenizer
from diffusion_gr2.core.text.examples import encode_requests, encode_sft, length_report
from diffusion_gr2.core.text.prompt import ItemLookup, PromptConfig
from diffusion_gr2.core.text.tokenizer import build_tokenizer, extend_tokenizer, sid_tokens_from_sids
from diffusion_gr2.core.text.traces import (
    AnalystConfig,
    RuleBasedAnalyst,
    build_sft_rows,
    corpus_texts,
    examples_from_frame,
    popularity_from_histories,
    rejection_sample,
    sft_frame,
    sft_rows_from_frame,
)
from diffusion_gr2.core.tracking.mlflow_utils import as_metrics_history


def _lookup(items: pd.DataFrame, sids: pd.DataFrame, params: dict[str, Any]) -> ItemLookup:
    return ItemLookup.from_frames(items, sids, PromptConfig(**params["prompt"]))


def generate_traces(
    candidates: pd.DataFrame,
    items: pd.DataFrame,
    sids: pd.DataFrame,
    splits: pd.DataFrame,
    params: dict[str, Any],
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Rule-based analyst traces for the training rows, kept only when the top pick is the target."""
    prompt_config = PromptConfig(**params["prompt"])
    lookup = _lookup(items, sids, params)
    popularity = popularity_from_histories(splits["train_items"])  # training data only: no leakage
    teacher = RuleBasedAnalyst(lookup, popularity, AnalystConfig(**params["analyst"]), prompt_config)
    train_rows = candidates[candidates["split"] == "train"]
    rows, stats = rejection_sample(
        teacher, examples_from_frame(train_rows), params["max_tries"], params["seed"]
    )
    return sft_frame(build_sft_rows(rows, lookup, prompt_config)), asdict(stats)


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
    params: dict[str, Any],
) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any], dict[str, Any]]:
    """Token ids of the SFT examples and of every re-ranking request, with the trace report."""
    sft_examples = encode_sft(sft_rows_from_frame(traces), tokenizer)
    requests = encode_requests(
        candidates, _lookup(items, sids, params), tokenizer, PromptConfig(**params["prompt"])
    )
    validate_requests(requests)  # every model stage reads it: a bad SID list stops here, named
    report = {**trace_stats, **length_report(sft_examples, requests), "vocab_size": len(tokenizer)}
    return sft_examples, requests, report, as_metrics_history(report)
