"""The re-ranker as a service: validated requests in raw item ids -> ranking, explanation, validity
(docs/operations.md#serving).

A request names items by their *raw* ids (the ids of the source data, as strings: MovieLens
``"50"``), because internal item ids are renumbered by every data preparation and so change with
each retrain. `Ranker` holds one model with its tokenizer, item catalogue (titles and SIDs) and
decoding settings, and re-ranks a batch of requests with the project's one decoder
(`core/rank/rerank.py`), under each request's answer grammar, so every served answer is a valid
ranking. The model's own validity (`unforced`: its answer decoded without the grammar is one the
grammar accepts, `rerank.own_validity`, the figure inference reports) is given beside it when the
call asks for it (the MLflow param `own_valid`; a diffusion model then decodes twice).

`RerankerModel` wraps a `Ranker` as an MLflow pyfunc model; `mlflow models serve` then answers
``POST /invocations``. `PrerankModel` is the baseline served when no re-ranker has passed the gate:
the retriever's order (the candidates as sent), validated the same way and answered in the same
format, labelled ``system: prerank``. A malformed request raises `RequestError` (an `MlflowException` with
INVALID_PARAMETER_VALUE), which the scoring server returns as HTTP 400 with the reason.

Both append every answered request to the request log (`core/serving/request_log.py`) when the
launcher (`python -m diffusion_gr2 serve`) put its settings in the environment; a request may carry
the raw `user_id`, which only the log reads (the shadow evaluation joins the user's next interaction).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.types import ColSpec, DataType, Schema
from mlflow.types.schema import Array, ParamSchema, ParamSpec

from diffusion_gr2.core.decode.grammar import answer_grammars
from diffusion_gr2.core.rank.rerank import (
    RerankConfig,
    decode_config_for,
    decode_requests,
    needs_own_pass,
    own_validity,
    prepare_model,
)
from diffusion_gr2.core.serving.request_log import RequestLogConfig, ServedModel, log_rows, open_log
from diffusion_gr2.core.text.evidence import Evidence, evidence_from_spec
from diffusion_gr2.core.text.parser import apply_fallback, parse_answer
from diffusion_gr2.core.text.prompt import ItemLookup, PromptConfig, build_messages
from diffusion_gr2.core.text.tokenizer import IM_END, decode_response, encode_prompt

logger = logging.getLogger(__name__)

__all__ = [
    "SIGNATURE",
    "PRERANK",
    "Limits",
    "PrerankModel",
    "PrerankRanker",
    "Ranker",
    "RequestError",
    "RerankerModel",
    "ServingConfig",
    "parse_request",
]

PRERANK = "prerank"  # ServingConfig.system of the retriever's order (no model)


@dataclass(frozen=True)
class Limits:
    """What one call may ask for; above it the request is refused (HTTP 400), never half-served.

    The scoring server reads the whole body before the model sees it, so a byte cap belongs in front
    of it (a proxy); these bounds keep every accepted call well inside the server's request timeout.
    """

    max_requests: int = 32  # rows per call
    max_history: int = 200  # history items per request (only the newest `history_in_prompt` are shown)
    min_candidates: int = 2
    max_candidates: int = 20  # the model is trained on N = 10
    max_id_chars: int = 64  # one raw item id


@dataclass(frozen=True)
class ServingConfig:
    """How a registered version serves: its system, operating point and decoding settings."""

    system: str  # "rl" (diffusion), "ar_rl" (the AR teacher) or "prerank" (the retriever's order)
    tau: float | None  # commit threshold; None for an AR system
    window: int | None = None  # decoding window of the operating point (None = whole block)
    decoding: dict[str, Any] = field(default_factory=dict)  # RerankConfig fields
    prompt: dict[str, Any] = field(default_factory=dict)  # PromptConfig fields
    # the prompt's evidence (`core/text/evidence.py`: settings and cuts) where the model was trained on
    # prompts showing it; its counts come from the catalogue's training sequences
    evidence: dict[str, Any] | None = None
    limits: dict[str, Any] = field(default_factory=dict)  # Limits fields

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ServingConfig:
        return cls(**json.loads(text))


class RequestError(MlflowException):
    """A malformed request; the scoring server answers HTTP 400 with this message."""

    def __init__(self, message: str) -> None:
        super().__init__(message, error_code=INVALID_PARAMETER_VALUE)


@dataclass(frozen=True)
class Request:
    """One validated request, in internal item ids (history oldest first, candidates in pre-rank order)."""

    request_id: str
    history: list[int]
    candidates: list[int]
    unknown_history: int  # history items the catalogue does not know (left out of the prompt)


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _id_list(row: int, name: str, value: Any, limits: Limits, cap: int) -> list[str]:
    """The raw ids of one list field, or a `RequestError` naming the row, the field and the problem."""
    if _is_missing(value):
        raise RequestError(f"request {row}: missing field '{name}' (a list of raw item ids as strings)")
    if isinstance(value, str | bytes | Mapping) or not hasattr(value, "__iter__"):
        raise RequestError(f"request {row}: '{name}' must be a list of item ids, got {type(value).__name__}")
    ids = list(value)
    if len(ids) > cap:
        raise RequestError(f"request {row}: '{name}' has {len(ids)} items, more than the limit {cap}")
    for item in ids:
        if not isinstance(item, str) or not item.strip():
            raise RequestError(f"request {row}: '{name}' holds {item!r}; item ids are non-empty strings")
        if len(item) > limits.max_id_chars:
            raise RequestError(f"request {row}: '{name}' holds an id longer than {limits.max_id_chars} chars")
    return ids


def parse_request(row: int, record: Mapping[str, Any], known: Mapping[str, int], limits: Limits) -> Request:
    """Validate one request (raw ids) against the catalogue `known` (raw id -> item id).

    Refused: a missing field, a field of the wrong type, too many items, an empty history (or one
    with no item the model knows), fewer than `min_candidates`, a repeated or unknown candidate, a
    candidate that is in the history (the leak the candidates schema refuses in training data:
    `no_candidate_in_history`, `target_not_in_history`).
    """
    history = _id_list(row, "history", record.get("history"), limits, limits.max_history)
    candidates = _id_list(row, "candidates", record.get("candidates"), limits, limits.max_candidates)
    if not history:
        raise RequestError(f"request {row}: 'history' is empty; the re-ranker needs the user's recent items")
    if len(candidates) < limits.min_candidates:
        raise RequestError(f"request {row}: {len(candidates)} candidates; at least {limits.min_candidates}")
    repeated = sorted({c for c in candidates if candidates.count(c) > 1})
    if repeated:
        raise RequestError(f"request {row}: candidate(s) {repeated[:5]} appear more than once")
    unknown = [c for c in candidates if c not in known]
    if unknown:
        raise RequestError(
            f"request {row}: unknown candidate id(s) {unknown[:5]} (not in the model's catalogue)"
        )
    seen = set(history)
    in_history = [c for c in candidates if c in seen]
    if in_history:
        raise RequestError(f"request {row}: candidate(s) {in_history[:5]} already in the history")
    kept = [known[h] for h in history if h in known]
    if not kept:
        raise RequestError(f"request {row}: no history item is in the model's catalogue")
    rid = record.get("request_id")
    return Request(
        request_id=str(row) if _is_missing(rid) else str(rid),
        history=kept,
        candidates=[known[c] for c in candidates],
        unknown_history=len(history) - len(kept),
    )


SEQUENCES_FILE = "sequences.parquet"  # a version's catalogue: the training sequences evidence counts


def _served_evidence(
    config: ServingConfig, sequences: pd.DataFrame | None, items: pd.DataFrame
) -> Evidence | None:
    """The evidence a version's prompts show, or None; a version trained on evidence whose catalogue
    lacks the training sequences is refused by name rather than served prompts it never saw."""
    if config.evidence is None:
        return None
    if sequences is None:
        raise ValueError(
            f"{config.system}: serving.evidence is set but the catalogue has no {SEQUENCES_FILE} "
            "(the training sequences its evidence is counted on); register the version again"
        )
    return evidence_from_spec(config.evidence, sequences, items)


class Ranker:
    """One model with everything it needs to answer requests in raw item ids."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        items: pd.DataFrame,
        sids: pd.DataFrame,
        config: ServingConfig,
        sequences: pd.DataFrame | None = None,
    ):
        self.config = config
        self.limits = Limits(**config.limits)
        self.prompt = PromptConfig(**config.prompt)
        self.lookup = ItemLookup.from_frames(items, sids, self.prompt)
        self.evidence = _served_evidence(config, sequences, items)
        self.tokenizer = tokenizer
        rerank_config = RerankConfig(**config.decoding)
        self.model = prepare_model(model, rerank_config.device)
        decode = decode_config_for(self.model, tokenizer, config.tau, rerank_config)
        self.decode = replace(decode, window=config.window) if config.tau is not None else decode
        self.constrained = rerank_config.constrained
        self.cite_prompt_sids = rerank_config.cite_prompt_sids
        in_lookup = items[items["item_id"].isin(list(self.lookup.items))]
        self.known = {
            str(r): int(i) for r, i in zip(in_lookup["raw_item_id"], in_lookup["item_id"], strict=True)
        }
        self.raw_of = {i: r for r, i in self.known.items()}

    @classmethod
    def from_dir(cls, model_dir: str | Path, catalogue_dir: str | Path, config: ServingConfig) -> Ranker:
        """Load a saved model folder (weights, config, tokenizer) and a catalogue folder (items, sids)."""
        from transformers import PreTrainedTokenizerFast

        from diffusion_gr2.core.model.factory import load_model

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)
        items = pd.read_parquet(Path(catalogue_dir) / "items.parquet")
        sids = pd.read_parquet(Path(catalogue_dir) / "sids.parquet")
        sequences_file = Path(catalogue_dir) / SEQUENCES_FILE
        sequences = pd.read_parquet(sequences_file) if sequences_file.exists() else None
        return cls(load_model(model_dir), tokenizer, items, sids, config, sequences)

    def messages(self, request: Request) -> list[dict[str, str]]:
        """The prompt of one request, as the model was trained on it (evidence included where it was:
        counted over every training sequence, since a served request has no training sequence of its
        own to leave out)."""
        shown = None
        if self.evidence is not None:
            shown = self.evidence.for_prompt(-1, request.history, request.candidates)
        return build_messages(request.history, request.candidates, self.lookup, self.prompt, shown)

    def parse(self, records: Sequence[Mapping[str, Any]]) -> list[Request]:
        """Every request validated; the first malformed one refuses the whole call."""
        if not records:
            raise RequestError("no requests in the call")
        if len(records) > self.limits.max_requests:
            raise RequestError(
                f"{len(records)} requests in one call; the limit is {self.limits.max_requests}"
            )
        return [parse_request(i, r, self.known, self.limits) for i, r in enumerate(records)]

    def rank(
        self, requests: Sequence[Request], batch_size: int | None = None, own_valid: bool = False
    ) -> list[dict[str, Any]]:
        """One answer per request: ranking (raw ids), explanation, validity, tau, forwards and latency.

        `batch_size` overrides the decoding batch (the gate times batch 1: one request's latency).
        `unforced` is the model's own validity (`rerank.own_validity`): always known for a system
        whose served pass shows it (AR), otherwise measured only with `own_valid` (a second, free
        pass, outside `latency_ms`) and None without it.
        """
        decode_config = self.decode if batch_size is None else replace(self.decode, batch_size=batch_size)
        start = time.perf_counter()
        prompts = [encode_prompt(self.tokenizer, self.messages(r)) for r in requests]
        sid_lists = [self.lookup.sids(r.candidates) for r in requests]
        cited = prompts if self.cite_prompt_sids else None  # the explanation cites the prompt's SIDs only
        grammars = answer_grammars(self.tokenizer, sid_lists, IM_END, cited) if self.constrained else None
        outputs = decode_requests(self.model, prompts, decode_config, desc="serve", grammars=grammars)
        latency_ms = 1000.0 * (time.perf_counter() - start)
        own: list[tuple[bool, list[str]]] | list[None] = [None] * len(requests)
        if own_valid or not needs_own_pass(decode_config, grammars):
            own = own_validity(
                self.model, prompts, outputs, sid_lists, self.tokenizer, decode_config, grammars, "serve"
            )
        answers = []
        for req, sids, out, mine in zip(requests, sid_lists, outputs, own, strict=True):
            parsed = parse_answer(decode_response(self.tokenizer, out.tokens), sids)
            item_of = dict(zip(sids, req.candidates, strict=True))
            answers.append(
                {
                    "request_id": req.request_id,
                    "ranking": [self.raw_of[item_of[s]] for s in apply_fallback(parsed, sids)],
                    "explanation": parsed.explanation or "",
                    "valid": bool(parsed.valid),  # as served (after the grammar)
                    "unforced": None if mine is None else bool(mine[0]),  # the model's own validity
                    "reason": parsed.reason,
                    "system": self.config.system,
                    "tau": self.config.tau,
                    "window": self.config.window,
                    "output_tokens": len(out.tokens),
                    "nfe": int(out.nfe),
                    "unknown_history": req.unknown_history,
                    "latency_ms": round(latency_ms, 2),  # the whole call, shared by its requests
                }
            )
        return answers


class PrerankRanker:
    """The retriever's order as a service: each request's candidates, as sent, validated like `Ranker`'s.

    The safe baseline a team can serve on day one (every model must beat it at the gate anyway).
    """

    def __init__(self, items: pd.DataFrame, config: ServingConfig):
        self.config = config
        self.limits = Limits(**config.limits)
        self.known = {str(r): int(i) for r, i in zip(items["raw_item_id"], items["item_id"], strict=True)}
        self.raw_of = {i: r for r, i in self.known.items()}

    parse = Ranker.parse  # the same validation: a malformed request is a 400 here too

    def rank(
        self, requests: Sequence[Request], batch_size: int | None = None, own_valid: bool = False
    ) -> list[dict[str, Any]]:
        """One answer per request in `Ranker.rank`'s format: the candidates in the order sent."""
        start = time.perf_counter()
        rankings = [[self.raw_of[c] for c in r.candidates] for r in requests]
        latency_ms = 1000.0 * (time.perf_counter() - start)
        return [
            {
                "request_id": req.request_id,
                "ranking": ranking,
                "explanation": "the retriever's order (pre-rank): no re-ranker has passed the gate",
                "valid": True,
                "unforced": True,  # no grammar wrote it
                "reason": "",
                "system": PRERANK,
                "tau": None,
                "window": None,
                "output_tokens": 0,
                "nfe": 0,
                "unknown_history": req.unknown_history,
                "latency_ms": round(latency_ms, 2),
            }
            for req, ranking in zip(requests, rankings, strict=True)
        ]


_IDS = Array(DataType.string)
# Every input column is optional in the schema so that a missing field reaches `parse_request` and
# gets a reason naming it (the schema's own refusal of a missing column would not say which request).
SIGNATURE = ModelSignature(
    inputs=Schema(
        [
            ColSpec(_IDS, "history", required=False),
            ColSpec(_IDS, "candidates", required=False),
            ColSpec(DataType.string, "request_id", required=False),
            ColSpec(DataType.string, "user_id", required=False),  # raw user id: the request log's only
        ]
    ),
    outputs=Schema(
        [
            ColSpec(DataType.string, "request_id"),
            ColSpec(_IDS, "ranking"),
            ColSpec(DataType.string, "explanation"),
            ColSpec(DataType.boolean, "valid"),
            ColSpec(DataType.boolean, "unforced", required=False),  # None unless asked (own_valid)
            ColSpec(DataType.string, "reason"),
            ColSpec(DataType.string, "system"),
            ColSpec(DataType.double, "tau", required=False),
            ColSpec(DataType.long, "window", required=False),
            ColSpec(DataType.long, "output_tokens"),
            ColSpec(DataType.long, "nfe"),
            ColSpec(DataType.long, "unknown_history"),
            ColSpec(DataType.double, "latency_ms"),
        ]
    ),
    # `own_valid`: also decode each request without the grammar and report `unforced` (costs a pass)
    params=ParamSchema([ParamSpec("own_valid", DataType.boolean, False)]),
)

INPUT_EXAMPLE = {"history": ["50", "172", "181"], "candidates": ["1", "2", "3"], "request_id": "r1"}


def _records(model_input: Any) -> list[dict[str, Any]]:
    """Rows of the scoring server's input (a DataFrame, or a list of dicts when called directly)."""
    if isinstance(model_input, pd.DataFrame):
        return model_input.to_dict("records")
    if isinstance(model_input, Mapping):
        return [dict(model_input)]
    if isinstance(model_input, list) and all(isinstance(r, Mapping) for r in model_input):
        return [dict(r) for r in model_input]
    raise RequestError(f"expected a table of requests, got {type(model_input).__name__}")


class _LoggedModel(mlflow.pyfunc.PythonModel):
    """A served model that appends each answered call to the request log (`request_log.py`)."""

    ranker: Ranker | PrerankRanker

    def _open_log(self) -> None:
        self.request_log = open_log(RequestLogConfig.from_env())
        self.served = ServedModel.from_env()
        if self.request_log is None:
            logger.info("request log off (no settings in the environment, or enabled: false)")

    def predict(self, context, model_input, params=None):  # noqa: ANN001 (see load_context)
        own_valid = bool((params or {}).get("own_valid", False))
        records = _records(model_input)
        answers = self.ranker.rank(self.ranker.parse(records), own_valid=own_valid)
        log = getattr(self, "request_log", None)  # a model unpickled without load_context has none
        if log is not None:
            try:
                log.append(log_rows(records, answers, self.served, "serve"))
            except OSError as err:  # the answer still goes out: serving outranks its record
                logger.error("request log: %d answers not logged: %s", len(answers), err)
        return pd.DataFrame(answers)


class RerankerModel(_LoggedModel):
    """The served re-ranker: artifacts `model` (folder), `catalogue` (folder), `serving` (JSON)."""

    def load_context(self, context):  # noqa: ANN001 (no hints: MLflow reads them as a schema)
        artifacts = context.artifacts
        config = ServingConfig.from_json(Path(artifacts["serving"]).read_text())
        self.ranker = Ranker.from_dir(artifacts["model"], artifacts["catalogue"], config)
        self._open_log()


class PrerankModel(_LoggedModel):
    """The served pre-rank: artifacts `catalogue` (folder) and `serving` (JSON); no model weights."""

    def load_context(self, context):  # noqa: ANN001 (no hints: MLflow reads them as a schema)
        artifacts = context.artifacts
        config = ServingConfig.from_json(Path(artifacts["serving"]).read_text())
        items = pd.read_parquet(Path(artifacts["catalogue"]) / "items.parquet")
        self.ranker = PrerankRanker(items, config)
        self._open_log()
