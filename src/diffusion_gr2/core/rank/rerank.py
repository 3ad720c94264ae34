"""Re-ranking with a trained model, and the evaluation of the rankings it produces (DESIGN §7, §8, §10).

`rerank` decodes every request with the one decoder, parses each answer against the request's
candidate SIDs and maps the SIDs back to item ids; an invalid answer is served the pre-rank order and
counted (DESIGN §4). Its rows are the `rankings.parquet` contract: every number in
`stage_metrics.json` is recomputable from them alone (`stage_metrics`).

`tau` is the commit threshold of block diffusion; AR systems have none (NaN in the frame, null in
JSON) and decode with block size 1 whatever their config says.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from diffusion_gr2.core.decode.decoder import DecodeConfig, DecodeOutput, decode
from diffusion_gr2.core.rank.metrics import METRICS, paired_bootstrap, stage_metrics_rows, user_values
from diffusion_gr2.core.text.parser import OK, apply_fallback, parse_answer
from diffusion_gr2.core.text.tokenizer import IM_END, decode_response

logger = logging.getLogger(__name__)

__all__ = [
    "AR_SYSTEMS",
    "DIFFUSION_SYSTEMS",
    "RANKING_COLUMNS",
    "SYSTEMS",
    "EvaluationConfig",
    "RerankConfig",
    "compare_systems",
    "decode_config_for",
    "decode_requests",
    "eval_metrics",
    "metrics_markdown",
    "prerank_rows",
    "prepare_model",
    "ranking_rows",
    "rerank",
    "resolve_device",
    "select_requests",
    "stage_metrics",
    "system_key",
]

SYSTEMS = ("prerank", "ar_sft", "ar_rl", "naive", "cft", "opd", "rl")  # DESIGN §10, in report order
AR_SYSTEMS = ("ar_sft", "ar_rl")
DIFFUSION_SYSTEMS = ("naive", "cft", "opd", "rl")
RANKING_COLUMNS = (
    "system",
    "tau",
    "user_id",
    "target",
    "prerank",
    "ranking",
    "valid",
    "reason",
    "output_tokens",
    "nfe",
    "output_text",
)


@dataclass(frozen=True)
class RerankConfig:
    """How the inference stage decodes; the model's config supplies block size and mask id."""

    max_new_tokens: int = 256  # reasoning (~130 tokens in the paper) + a 10-SID JSON answer
    batch_size: int = 16  # rows decoded together
    max_steps_per_block: int | None = None  # None -> block size (the decoder's default cap)
    device: str = "auto"  # "auto" = cuda when available, else cpu


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
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, tau: float | None, config: RerankConfig
) -> DecodeConfig:
    """Greedy `DecodeConfig` for `model`: block size and mask id from its config, eos/pad from the tokenizer.

    `tau=None` means an AR system: block size 1. Otherwise the model must be a converted
    block-diffusion model (`config.block_size`, set by conversion).
    """
    block_size, mask_id, threshold = 1, None, DecodeConfig.threshold
    if tau is not None:
        block_size = getattr(model.config, "block_size", None)
        if block_size is None:
            raise ValueError("tau given but the model has no config.block_size: not a block-diffusion model")
        mask_id = getattr(model.config, "mask_token_id", None) or tokenizer.mask_token_id
        threshold = float(tau)
    return DecodeConfig(
        block_size=int(block_size),
        threshold=threshold,
        max_new_tokens=config.max_new_tokens,
        max_steps_per_block=config.max_steps_per_block,
        eos_token_ids=_eos_ids(tokenizer),
        mask_token_id=mask_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        batch_size=config.batch_size,
    )


def select_requests(requests: pd.DataFrame, split: str = "test", max_users: int | None = None) -> pd.DataFrame:
    """Rows of `split`, sorted by user id; the first `max_users` of them when capped (deterministic)."""
    rows = requests[requests["split"] == split].sort_values("user_id", kind="stable")
    if max_users is not None:
        rows = rows.head(int(max_users))
    return rows.reset_index(drop=True)
