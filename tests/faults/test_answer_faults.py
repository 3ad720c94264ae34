"""Bad model outputs and bad grammar inputs: an invalid answer with its reason, or a ValueError at
grammar construction naming the SID, never a crash mid-decoding."""

from __future__ import annotations

import json

import pytest

from diffusion_gr2.core.decode.grammar import AnswerGrammar
from diffusion_gr2.core.decode.grammar_tokens import GrammarTokens
from diffusion_gr2.core.text import parser as P
from diffusion_gr2.core.text.parser import parse_answer
from diffusion_gr2.core.text.tokenizer import IM_END, build_tokenizer

SIDS = [f"<a_{i}><b_{i % 3}>" for i in range(10)]
OK_RANKING = SIDS[::-1]


def answer(recs: object = None, **extra: object) -> str:
    return json.dumps(
        {"explanation": "why", "recommendations": OK_RANKING if recs is None else recs, **extra}
    )


PARSER_CASES: list[tuple[str, str, list[str], str]] = [
    ("duplicate_key", answer()[:-1] + ', "recommendations": []}', SIDS, P.DUPLICATE_KEY),
    ("nan_value", answer(explanation=float("nan")), SIDS, P.INVALID_JSON),
    ("infinity_in_list", answer()[:-2] + ", Infinity]}", SIDS, P.INVALID_JSON),
    ("huge_integer", answer()[:-2] + ", " + "9" * 5000 + "]}", SIDS, P.INVALID_JSON),
    ("deep_nesting", "[" * 50_000 + "]" * 50_000, SIDS, P.INVALID_JSON),
    ("repeated_candidate_sid_nine_items", answer(SIDS[1:]), [SIDS[1], *SIDS[1:]], P.AMBIGUOUS_CANDIDATES),
    ("nine_of_ten", answer(SIDS[1:]), SIDS, P.WRONG_LENGTH),
    ("duplicate_id", answer([SIDS[0], *SIDS[:9]]), SIDS, P.DUPLICATE_ID),
    ("foreign_id", answer(["<a_99><b_0>", *SIDS[1:]]), SIDS, P.FOREIGN_ID),
    ("non_string_id", answer([1, *SIDS[1:]]), SIDS, P.NON_STRING_ID),
    ("trailing_text", answer() + " and more", SIDS, P.TRAILING_TEXT),
    ("two_objects", answer() + answer(), SIDS, P.TRAILING_TEXT),
    ("lone_surrogate_escape", answer()[:-1] + ', "x": "\\ud800"}', SIDS, P.OK),  # valid JSON, valid ranking
    ("not_text", b"bytes", SIDS, P.NOT_TEXT),  # type: ignore[list-item]
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "cands", "reason"), [c[1:] for c in PARSER_CASES], ids=[c[0] for c in PARSER_CASES]
)
def test_parser_outcome(text: str, cands: list[str], reason: str) -> None:
    parsed = parse_answer(text, cands)
    assert parsed.reason == reason
    assert parsed.valid == (reason == P.OK) and (parsed.ranking is None) == (reason != P.OK)


@pytest.fixture(scope="module")
def grammar_tokens() -> GrammarTokens:
    sid_tokens = [f"<a_{i}>" for i in range(10)] + [f"<b_{i}>" for i in range(3)] + ["<c_0>"]
    tokenizer = build_tokenizer([answer(), "The user likes dramas."] * 3, sid_tokens, vocab_size=300)
    return GrammarTokens.from_tokenizer(tokenizer, IM_END)


GRAMMAR_CASES = [
    ("tokenless_empty", ["", *SIDS[1:]], r"SID '' is not a run of SID tokens"),
    ("tokenless_text", ["abc", *SIDS[1:]], r"SID 'abc' is not a run of SID tokens"),
    ("two_tokenless", ["", "", *SIDS[2:]], r"SID '' is not a run of SID tokens"),
    ("text_between_tokens", ["<a_0>x<b_0>", *SIDS[1:]], r"SID '<a_0>x<b_0>' is not a run"),
    ("leading_space", [" <a_0><b_0>", *SIDS[1:]], r"SID ' <a_0><b_0>' is not a run"),
    ("not_a_string", [None, *SIDS[1:]], r"SID None is not a run"),
    ("unknown_token", ["<a_0><z_9>", *SIDS[1:]], r"token <z_9> is not in the tokenizer"),
    ("duplicate_sid", [SIDS[1], *SIDS[1:]], r"duplicate candidate SIDs \['<a_1><b_1>'\]"),
    ("unequal_lengths", ["<a_0><b_0><c_0>", *SIDS[1:]], r"differ in token length"),
    ("no_candidates", [], r"at least one candidate SID"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("sids", "pattern"), [c[1:] for c in GRAMMAR_CASES], ids=[c[0] for c in GRAMMAR_CASES]
)
def test_grammar_refuses_bad_candidates_at_construction(
    grammar_tokens: GrammarTokens, sids: list[str], pattern: str
) -> None:
    with pytest.raises(ValueError, match=pattern):
        AnswerGrammar(grammar_tokens, sids)


def test_grammar_accepts_well_formed_candidates(grammar_tokens: GrammarTokens) -> None:
    grammar = AnswerGrammar(grammar_tokens, SIDS)
    assert grammar.sid_length == 2 and len(grammar.remaining) == 10
