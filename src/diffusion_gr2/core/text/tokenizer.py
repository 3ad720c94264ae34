"""Tokenizer: a small byte-level BPE trained offline on the project's own text, plus SID tokens.

Byte-level BPE round-trips any text (JSON punctuation, digits, unicode). Every SID token (`<a_12>`) is
an added token, so one SID is exactly four tokens. The same `extend_tokenizer` adds the SID tokens, the
chat specials and `[MASK]` to a pretrained tokenizer (Qwen3 in production).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from diffusion_gr2.core.text.prompt import split_sid

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # end of a message, and the end-of-output token of every response
END_OF_TEXT = "<|endoftext|>"
PAD = "<pad>"
MASK = "[MASK]"  # the block-diffusion mask token (docs/architecture.md#models-and-attention)
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END, PAD, MASK)

# Qwen-style template: `<|im_start|>role\ncontent<|im_end|>\n` per message. Installed on every
# tokenizer (ours or pretrained) so prompts have the same shape whatever the model.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
GENERATION_PROMPT = f"{IM_START}assistant\n"
REASONING, ANSWER = 0, 1  # response roles: explanation tokens vs recommendations + end token
_ANSWER_KEY = '"recommendations"'  # json.dumps escapes quotes inside strings, so this is the key


@dataclass(frozen=True)
class EncodedExample:
    """Token ids of one training example; `response_roles[j]` is the role of `response_ids[j]`."""

    prompt_ids: list[int]  # [p], ends with the generation prompt `<|im_start|>assistant\n`
    response_ids: list[int]  # [r], the answer text then `<|im_end|>`
    response_roles: list[int]  # [r], REASONING (0) or ANSWER (1)


def sid_tokens_from_sids(sids: Iterable[str]) -> list[str]:
    """The distinct SID tokens used by `sids` (sorted by level then code), for `build_tokenizer`."""
    tokens = {t for s in sids for t in split_sid(s)}
    return sorted(tokens, key=lambda t: (t.split("_")[0], int(t.rstrip(">").split("_")[-1])))


def _strip_added(texts: Iterable[str], added: Sequence[str]) -> Iterator[str]:
    """Texts with SID and special tokens removed: they are added tokens, so BPE must not learn them."""
    pattern = re.compile("|".join(re.escape(t) for t in sorted(set(added), key=len, reverse=True)))
    for text in texts:
        yield pattern.sub(" ", text)


def _train_bpe(corpus_texts: Iterable[str], vocab_size: int, min_frequency: int) -> Tokenizer:
    """Byte-level BPE with the special tokens at ids 0..4."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is ever unknown
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts, trainer=trainer)
    return tok


def build_tokenizer(
    corpus_texts: Iterable[str], sid_tokens: Sequence[str], vocab_size: int = 2000, min_frequency: int = 2
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `corpus_texts` and add the SID tokens, specials and chat template.

    `vocab_size` counts the BPE part only (specials included); the SID tokens come on top of it.
    """
    roles = ["system\n", "user\n", "assistant\n"] * min_frequency  # the template's words
    texts = _strip_added([*corpus_texts, *roles], [*sid_tokens, *SPECIAL_TOKENS])
    base = PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(texts, vocab_size, min_frequency), clean_up_tokenization_spaces=False
    )
    return extend_tokenizer(base, sid_tokens)


def extend_tokenizer(
    tokenizer: PreTrainedTokenizerFast, sid_tokens: Sequence[str]
) -> PreTrainedTokenizerFast:
    """A copy of `tokenizer` with SID tokens, chat specials, `[MASK]`, a pad token and the chat template.

    SID tokens are plain (non-special) added tokens, so `skip_special_tokens=True` keeps them. The eos
    token becomes `<|im_end|>`, which ends every response; an existing pad token is kept unless it is
    that end token (padding must never read as the end of an output).
    """
    tok = copy.deepcopy(tokenizer)
    specials = [AddedToken(t, special=True, normalized=False) for t in (IM_START, IM_END, END_OF_TEXT)]
    tok.add_special_tokens({"extra_special_tokens": specials}, replace_extra_special_tokens=False)
    tok.add_special_tokens({"eos_token": IM_END, "mask_token": MASK})
    if tok.pad_token is None or tok.pad_token == IM_END:  # SmolLM2 pads with its eos; we must not
        tok.add_special_tokens({"pad_token": PAD})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in sid_tokens])
    tok.chat_template = CHAT_TEMPLATE
    tok.clean_up_tokenization_spaces = False  # decode must give back the exact text
    return tok


def encode_prompt(tokenizer: PreTrainedTokenizerFast, messages: Sequence[dict[str, str]]) -> list[int]:
    """[p] ids of the chat prompt, ending with the generation prompt `<|im_start|>assistant\\n`."""
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def response_roles(response_text: str, offsets: Sequence[tuple[int, int]]) -> list[int]:
    """Role of each response token from its character span (end-exclusive).

    A token is ANSWER once it reaches the `"recommendations"` key (a token straddling the boundary
    counts as answer); a response without that key is all ANSWER (it has no explanation part).
    """
    boundary = response_text.find(_ANSWER_KEY)
    if boundary < 0:
        return [ANSWER] * len(offsets)
    return [ANSWER if end > boundary else REASONING for _, end in offsets]


def encode_example(
    tokenizer: PreTrainedTokenizerFast, messages: Sequence[dict[str, str]], response_text: str
) -> EncodedExample:
    """Prompt ids, response ids (`response_text` then `<|im_end|>`) and per-token roles."""
    enc = tokenizer(response_text, add_special_tokens=False, return_offsets_mapping=True)
    roles = response_roles(response_text, enc["offset_mapping"]) + [ANSWER]  # the end token is answer
    return EncodedExample(
        prompt_ids=encode_prompt(tokenizer, messages),
        response_ids=[*enc["input_ids"], tokenizer.convert_tokens_to_ids(IM_END)],
        response_roles=roles,
    )


def decode_response(tokenizer: PreTrainedTokenizerFast, ids: Iterable[int]) -> str:
    """Text of generated ids up to (not including) the first `<|im_end|>`.

    Other special tokens (a left-over `[MASK]`) stay in the text so the parser rejects the answer.
    """
    end_id = tokenizer.convert_tokens_to_ids(IM_END)
    kept: list[int] = []
    for i in ids:
        if int(i) == end_id:
            break
        kept.append(int(i))
    return tokenizer.decode(kept, skip_special_tokens=False, clean_up_tokenization_spaces=False)
