from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffusion_gr2.core.text import parser as P
from diffusion_gr2.core.text.parser import ParsedAnswer, apply_fallback, parse_answer
from diffusion_gr2.core.text.prompt import render_answer

CANDS = [f"<a_{i}><b_{i % 3}><c_{i % 5}><d_0>" for i in range(10)]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_never_raises_on_arbitrary_text(text: str) -> None:
    parsed = parse_answer(text, CANDS)
    assert isinstance(parsed, ParsedAnswer)
    assert parsed.valid == (parsed.reason == P.OK) == (parsed.ranking is not None)


@settings(max_examples=200, deadline=None)
@given(json_values, st.sampled_from(CANDS), st.booleans())
def test_never_raises_on_json_shapes(value: object, sid: str, wrap: bool) -> None:
    """JSON that is almost an answer: arbitrary values, optionally under `recommendations`."""
    obj = {"explanation": value, "recommendations": [sid, value]} if wrap else value
    parsed = parse_answer(json.dumps(obj), CANDS)
    assert not parsed.valid and parsed.ranking is None


@settings(max_examples=200, deadline=None)
@given(
    st.permutations(CANDS),
    st.text(max_size=200),
    st.sampled_from(["", " \n", "<|im_end|>", "\n<|im_end|><pad>"]),
)
def test_rendered_answer_round_trips(perm: list[str], explanation: str, tail: str) -> None:
    parsed = parse_answer("  " + render_answer(explanation, perm) + tail, CANDS)
    assert parsed.valid, parsed.reason
    assert parsed.ranking == tuple(perm)
    assert parsed.explanation == explanation


def _answer(recs: list[object]) -> str:
    return json.dumps({"explanation": "why", "recommendations": recs})


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (_answer(CANDS[:9] + CANDS[:1]), P.DUPLICATE_ID),
        (_answer(CANDS[:9] + ["<a_99><b_0><c_0><d_0>"]), P.FOREIGN_ID),
        (_answer(CANDS[:9]), P.WRONG_LENGTH),
        (_answer(CANDS)[:-7], P.INVALID_JSON),  # truncated mid-list
        (_answer(CANDS) + ' {"x": 1}', P.TRAILING_TEXT),
        (_answer(CANDS) + "<|im_end|> more", P.TRAILING_TEXT),  # text after the end token
        (_answer(CANDS[:9] + [7]), P.NON_STRING_ID),
        (json.dumps({"explanation": "why", "recommendations": ",".join(CANDS)}), P.NOT_A_LIST),
        (json.dumps({"explanation": "why"}), P.MISSING_RECOMMENDATIONS),
        (json.dumps(CANDS), P.NOT_OBJECT),
        ("  <|im_end|>", P.EMPTY),
        ("The best item is <a_1><b_1><c_1><d_0>", P.INVALID_JSON),
        ("[" * 100_000, P.INVALID_JSON),  # deep nesting must not crash the parser
    ],
)
def test_invalid_answers_are_rejected_with_reason(text: str, reason: str) -> None:
    parsed = parse_answer(text, CANDS)
    assert (parsed.valid, parsed.reason, parsed.ranking) == (False, reason, None)


def test_non_text_and_explanation_kept_when_ranking_invalid() -> None:
    assert parse_answer(None, CANDS).reason == P.NOT_TEXT
    parsed = parse_answer(_answer(CANDS[:3]), CANDS)
    assert parsed.explanation == "why" and not parsed.valid


def test_fallback_uses_prerank_only_when_invalid() -> None:
    prerank = tuple(CANDS)
    good = parse_answer(render_answer("e", CANDS[::-1]), CANDS)
    bad = parse_answer(render_answer("e", CANDS[:5]), CANDS)
    assert apply_fallback(good, prerank) == tuple(CANDS[::-1])
    assert apply_fallback(bad, prerank) == prerank
