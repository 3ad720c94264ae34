"""Output parser: model text -> ranking of candidate SIDs plus a validity flag
(docs/architecture.md#items-candidates-and-prompts).

A ranking is valid only when the text is one strict JSON object (no repeated key, no NaN/Infinity)
whose `recommendations` is a permutation of the N candidate SIDs. Nothing is repaired (no dropping duplicates, no appending missing IDs as rank_llm does):
closing that structural gap is the model's job (CFT); an invalid answer falls back to the pre-rank.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

# Tokens a decoder may leave at the end of the text; everything before them must be the JSON object.
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<pad>")

OK = "ok"
NOT_TEXT = "not_text"
EMPTY = "empty"
INVALID_JSON = "invalid_json"
DUPLICATE_KEY = "duplicate_key"
TRAILING_TEXT = "trailing_text"
NOT_OBJECT = "not_object"
MISSING_RECOMMENDATIONS = "missing_recommendations"
NOT_A_LIST = "recommendations_not_list"
NON_STRING_ID = "non_string_id"
FOREIGN_ID = "foreign_id"
DUPLICATE_ID = "duplicate_id"
WRONG_LENGTH = "wrong_length"
# The request, not the answer, is broken: two candidates share a SID, so no answer can name each once.
AMBIGUOUS_CANDIDATES = "ambiguous_candidates"


class _DuplicateKey(ValueError):
    """A JSON object names one key twice: which value the model meant is undefined."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    record = dict(pairs)
    if len(record) != len(pairs):
        raise _DuplicateKey
    return record


def _no_constant(name: str) -> object:
    """NaN, Infinity and -Infinity are Python extensions, not JSON."""
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys, parse_constant=_no_constant)


@dataclass(frozen=True)
class ParsedAnswer:
    """Result of parsing one answer; `ranking` is set only when `valid`."""

    ranking: tuple[str, ...] | None  # candidate SIDs, best first
    valid: bool
    reason: str  # OK or the first problem found (one of the constants above)
    explanation: str | None  # the explanation string when the JSON object has one


def _strip_end_tokens(text: str) -> str:
    """Remove surrounding whitespace and any run of trailing end tokens."""
    text = text.strip()
    stripped = True
    while stripped:
        stripped = False
        for token in END_TOKENS:
            if text.endswith(token):
                text = text[: -len(token)].rstrip()
                stripped = True
    return text


def _load_object(text: str) -> tuple[object, str]:
    """Decode exactly one JSON value from `text`; returns (value, OK) or (None, reason)."""
    try:
        value, end = _DECODER.raw_decode(text)
    except _DuplicateKey:
        return None, DUPLICATE_KEY
    except (ValueError, RecursionError):  # JSONDecodeError, NaN, huge integers, deeply nested arrays
        return None, INVALID_JSON
    if text[end:].strip():
        return None, TRAILING_TEXT
    return value, OK


def _check_ranking(recs: object, candidate_sids: Sequence[str]) -> str:
    """OK when `recs` is a permutation of `candidate_sids`, else the reason it is not."""
    if not isinstance(recs, list):
        return NOT_A_LIST
    if not all(isinstance(r, str) for r in recs):
        return NON_STRING_ID
    allowed = set(candidate_sids)
    if any(r not in allowed for r in recs):
        return FOREIGN_ID
    if len(set(recs)) != len(recs):
        return DUPLICATE_ID
    if len(recs) != len(candidate_sids):
        return WRONG_LENGTH
    return OK


def parse_answer(text: object, candidate_sids: Sequence[str]) -> ParsedAnswer:
    """Parse a model answer; never raises, whatever `text` is.

    Candidate SIDs that repeat make every answer invalid (`AMBIGUOUS_CANDIDATES`): a ranking could
    then leave a candidate out and still look complete. The requests schema refuses such lists first.

    Leading/trailing whitespace and trailing end tokens (`<|im_end|>`, ...) are tolerated; anything
    else around the JSON object makes the answer invalid.
    """
    if len(set(candidate_sids)) != len(candidate_sids):
        return ParsedAnswer(None, False, AMBIGUOUS_CANDIDATES, None)
    if not isinstance(text, str):
        return ParsedAnswer(None, False, NOT_TEXT, None)
    body = _strip_end_tokens(text)
    if not body:
        return ParsedAnswer(None, False, EMPTY, None)
    value, reason = _load_object(body)
    if reason != OK:
        return ParsedAnswer(None, False, reason, None)
    if not isinstance(value, dict):
        return ParsedAnswer(None, False, NOT_OBJECT, None)
    explanation = value.get("explanation")
    explanation = explanation if isinstance(explanation, str) else None
    if "recommendations" not in value:
        return ParsedAnswer(None, False, MISSING_RECOMMENDATIONS, explanation)
    recs = value["recommendations"]
    reason = _check_ranking(recs, candidate_sids)
    if reason != OK:
        return ParsedAnswer(None, False, reason, explanation)
    return ParsedAnswer(tuple(recs), True, OK, explanation)


def apply_fallback(parsed: ParsedAnswer, prerank_sids: Sequence[str]) -> tuple[str, ...]:
    """The parsed ranking when valid, else the pre-rank order (counted as a fallback:
    docs/architecture.md#items-candidates-and-prompts)."""
    if parsed.valid and parsed.ranking is not None:
        return parsed.ranking
    return tuple(prerank_sids)
