from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from diffusion_gr2.core.text.parser import parse_answer
from diffusion_gr2.core.text.prompt import render_answer, split_sid
from diffusion_gr2.core.text.tokenizer import (
    ANSWER,
    GENERATION_PROMPT,
    IM_END,
    MASK,
    PAD,
    REASONING,
    SPECIAL_TOKENS,
    decode_response,
    encode_example,
    encode_prompt,
    extend_tokenizer,
    sid_tokens_from_sids,
)
from diffusion_gr2.core.text.traces import SFTRow

from .synthetic import sid_tokens

ALL_SIDS = st.tuples(*(st.integers(0, s - 1) for s in (16, 16, 16, 4))).map(
    lambda c: f"<a_{c[0]}><b_{c[1]}><c_{c[2]}><d_{c[3]}>"
)


def _round_trip(tok: PreTrainedTokenizerFast, text: str) -> str:
    return tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_text_round_trips(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    assert _round_trip(tokenizer, text) == text


@settings(max_examples=100, deadline=None)
@given(st.lists(ALL_SIDS, min_size=1, max_size=10), st.text(max_size=80))
def test_answers_round_trip_and_each_sid_is_four_tokens(
    tokenizer: PreTrainedTokenizerFast, sids: list[str], explanation: str
) -> None:
    text = render_answer(f"{explanation} pick {sids[0]}.", sids)
    assert _round_trip(tokenizer, text) == text
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode(text, add_special_tokens=False))
    for sid in sids:
        assert len(tokenizer.encode(sid, add_special_tokens=False)) == 4
        assert tokenizer.convert_ids_to_tokens(tokenizer.encode(sid, add_special_tokens=False)) == split_sid(
            sid
        )
    sid_parts = [t for t in tokens if t.startswith("<") and t.endswith(">") and t[1] in "abcd"]
    assert len(sid_parts) == 4 * (len(sids) + 1)  # every SID in the text is its four parts, never split


def test_prompts_round_trip(tokenizer: PreTrainedTokenizerFast, sft_rows: list[SFTRow]) -> None:
    for row in sft_rows[:20]:
        text = tokenizer.apply_chat_template(row.messages, add_generation_prompt=True, tokenize=False)
        assert text.endswith(GENERATION_PROMPT)
        assert _round_trip(tokenizer, text) == text
        assert tokenizer.decode(encode_prompt(tokenizer, row.messages)) == text


def test_specials(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS) and tokenizer.unk_token_id not in ids
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.mask_token) == (IM_END, PAD, MASK)
    for t in SPECIAL_TOKENS:
        assert tokenizer.encode(t, add_special_tokens=False) == [tokenizer.convert_tokens_to_ids(t)]
    # SID tokens are plain added tokens: skipping specials keeps them
    assert tokenizer.decode(tokenizer.encode("<a_3><b_1><c_0><d_2>[MASK]"), skip_special_tokens=True) == (
        "<a_3><b_1><c_0><d_2>"
    )
    assert len(tokenizer) <= 2000 + len(sid_tokens())


def test_encode_example_roles(tokenizer: PreTrainedTokenizerFast, sft_rows: list[SFTRow]) -> None:
    row = sft_rows[0]
    ex = encode_example(tokenizer, row.messages, row.response_text)
    gen_prompt = tokenizer.encode(GENERATION_PROMPT, add_special_tokens=False)
    assert ex.prompt_ids[-len(gen_prompt) :] == gen_prompt
    assert ex.response_ids[-1] == tokenizer.eos_token_id
    assert len(ex.response_ids) == len(ex.response_roles)
    first_answer = ex.response_roles.index(ANSWER)
    assert set(ex.response_roles[:first_answer]) == {REASONING}  # reasoning first, then answer only
    assert set(ex.response_roles[first_answer:]) == {ANSWER}
    reasoning = tokenizer.decode(ex.response_ids[:first_answer])
    answer = tokenizer.decode(ex.response_ids[first_answer:])
    assert reasoning.startswith('{"explanation":"1)') and "recommendations" not in reasoning
    # the boundary token may also carry the explanation's closing punctuation (BPE merges `.","`)
    head, _, _ = answer.partition('"recommendations"')
    assert len(head) <= 4 and not any(c.isalnum() for c in head)
    assert reasoning + answer == row.response_text + IM_END
    assert answer.endswith("]}" + IM_END)
    assert decode_response(tokenizer, ex.response_ids + [tokenizer.pad_token_id] * 3) == row.response_text


def test_roles_without_explanation_are_all_answer(tokenizer: PreTrainedTokenizerFast) -> None:
    ex = encode_example(tokenizer, [{"role": "user", "content": "hi"}], "no json here")
    assert set(ex.response_roles) == {ANSWER}


def test_decode_response_keeps_left_over_masks(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode('{"explanation":"x"' + MASK, add_special_tokens=False)
    text = decode_response(tokenizer, ids)
    assert text.endswith(MASK) and not parse_answer(text, ["<a_0><b_0><c_0><d_0>"]).valid


def test_save_and_reload(tokenizer: PreTrainedTokenizerFast, sft_rows: list[SFTRow], tmp_path: Path) -> None:
    tokenizer.save_pretrained(tmp_path)
    row = sft_rows[1]
    expected = encode_example(tokenizer, row.messages, row.response_text)
    for loaded in (
        AutoTokenizer.from_pretrained(tmp_path),
        PreTrainedTokenizerFast.from_pretrained(tmp_path),
    ):
        assert len(loaded) == len(tokenizer)
        assert (loaded.mask_token_id, loaded.eos_token_id, loaded.pad_token_id) == (
            tokenizer.mask_token_id,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
        )
        assert encode_example(loaded, row.messages, row.response_text) == expected


def _foreign_tokenizer() -> PreTrainedTokenizerFast:
    """A stand-in for a pretrained tokenizer: its own BPE and specials, none of ours."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["plain words only"] * 3, trainer=trainers.BpeTrainer(special_tokens=["<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_extend_pretrained_tokenizer() -> None:
    base = _foreign_tokenizer()
    n_base = len(base)
    tok = extend_tokenizer(base, sid_tokens())
    assert len(base) == n_base  # the input tokenizer is not modified
    assert len(tok) == n_base + len(SPECIAL_TOKENS) + len(sid_tokens())
    assert tok.encode("<a_15><b_0><c_9><d_3>", add_special_tokens=False) == tok.convert_tokens_to_ids(
        ["<a_15>", "<b_0>", "<c_9>", "<d_3>"]
    )
    assert tok.mask_token == MASK and tok.eos_token == IM_END
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "plain"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nplain<|im_end|>\n" + GENERATION_PROMPT


def test_sid_tokens_from_sids() -> None:
    assert sid_tokens_from_sids(["<a_10><b_2><c_0><d_1>", "<a_2><b_2><c_3><d_0>"]) == [
        "<a_2>",
        "<a_10>",
        "<b_2>",
        "<c_0>",
        "<c_3>",
        "<d_0>",
        "<d_1>",
    ]


@pytest.mark.parametrize("text", ["12.99 $ 0007", '{"a":[1,2]}', "naïve 東京 😀", "\t\n\r  x"])
def test_digits_punctuation_unicode(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    assert _round_trip(tokenizer, text) == text
