"""The answer format's literals and the token tables the answer grammar reads (`grammar.py`).

The compact JSON every trace is written in (`render_answer`):

    {"explanation":"<JSON string text>","recommendations":["<sid>","<sid>",...]}<|im_end|>

is the literals below around a free explanation string and a list of SIDs. Tokens are matched on
their decoded text, so the grammar works with any tokenizer whose SID tokens are single added tokens
(ours, or Qwen3's extended by `extend_tokenizer`). `GrammarTokens` holds what only depends on the
tokenizer, built once and shared by every request: each token's text, which tokens continue (or
close) the explanation string, which continue a literal, and the SID tokens. The SID helpers
(`sid_token_ids`, `list_key_ids`, `prompt_sids`) read the same tables for the decoder's SID gate and
the grammar's citations.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from diffusion_gr2.core.text.prompt import split_sid
from diffusion_gr2.core.text.tokenizer import SPECIAL_TOKENS

__all__ = [
    "CLOSE",
    "END",
    "LIST_KEY",
    "OPEN",
    "SEPARATOR",
    "SID_TOKEN",
    "GrammarTokens",
    "list_key_ids",
    "prompt_sids",
    "scan_text",
    "sid_token_ids",
]

OPEN = '{"explanation":"'
LIST_KEY = "recommendations"  # the ranking list's key
CLOSE = f'","{LIST_KEY}":["'  # ends with the first SID's opening quote
SEPARATOR = '","'
END = '"]}'
# JSON escapes after a backslash; a unicode escape (backslash-u and four hex digits) is not accepted:
# traces are written with ensure_ascii=False and cleaned of control characters, so none has one.
_ESCAPES = set('"\\/bfnrt')
SID_TOKEN = re.compile(r"<[a-z]_\d+>")  # one level of a SID (`rqvae.py` writes `<a_12><b_3>...`)


def scan_text(text: str, escaped: bool) -> tuple[str, bool | int] | None:
    """Run `text` through the explanation string starting in escape state `escaped`.

    Returns ("text", escaped_after), ("close", chars of CLOSE consumed) when an unescaped quote starts
    the closing literal, or None when `text` cannot continue a JSON string here.
    """
    for i, ch in enumerate(text):
        if escaped:
            if ch not in _ESCAPES:
                return None
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            rest = text[i:]
            return ("close", len(rest)) if CLOSE.startswith(rest) else None
        elif ord(ch) < 0x20:  # raw control characters are not allowed inside a JSON string
            return None
    return ("text", escaped)


@dataclass
class GrammarTokens:
    """Per-tokenizer tables: each token's text, and the explanation-string masks (built once)."""

    tokenizer: PreTrainedTokenizerBase
    texts: list[str]
    eos_id: int
    vocab: dict[str, int]  # token -> id (SID tokens are looked up here)
    text_masks: dict[bool, Tensor]  # escape pending -> tokens that continue (or close) the explanation
    close_masks: dict[bool, Tensor]  # escape pending -> tokens that (also) start the closing literal
    text_effects: dict[tuple[bool, int], tuple[str, bool | int]]  # (escaped, id) -> `scan_text` result
    sid_tokens: Tensor  # bool [v]: the SID tokens (one level each)
    # caches, filled on first use: literal -> canonical ids, (literal, then text) -> allowed mask,
    # and the one token such a mask allows (None: several)
    _canonical: dict[str, list[int]] = field(default_factory=dict, repr=False)
    _literal_masks: dict[tuple[str, bool], Tensor] = field(default_factory=dict, repr=False)
    _literal_only: dict[tuple[str, bool], int | None] = field(default_factory=dict, repr=False)

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase, eos_token: str) -> GrammarTokens:
        eos_id = tokenizer.convert_tokens_to_ids(eos_token)
        if eos_id is None or eos_id == tokenizer.unk_token_id:
            raise ValueError(f"tokenizer has no {eos_token!r} token")
        vocab = len(tokenizer)
        texts = [tokenizer.decode([i]) for i in range(vocab)]
        special = {tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS} | set(
            tokenizer.all_special_ids
        )
        text_masks, close_masks, effects = {}, {}, {}
        for escaped in (False, True):
            text_ok = torch.zeros(vocab, dtype=torch.bool)
            close_ok = torch.zeros(vocab, dtype=torch.bool)
            for i, t in enumerate(texts):
                if i in special or not t:
                    continue
                result = scan_text(t, escaped)  # SID tokens are plain text: they may be cited
                if result is None:
                    continue
                effects[(escaped, i)] = result
                (close_ok if result[0] == "close" else text_ok)[i] = True
            text_masks[escaped], close_masks[escaped] = text_ok | close_ok, close_ok
        sid_tokens = torch.tensor([bool(SID_TOKEN.fullmatch(t)) for t in texts], dtype=torch.bool)
        return cls(
            tokenizer, texts, eos_id, tokenizer.get_vocab(), text_masks, close_masks, effects, sid_tokens
        )

    def canonical_ids(self, literal: str) -> list[int]:
        """How the tokenizer writes `literal` (what a trained model has seen)."""
        if literal not in self._canonical:
            self._canonical[literal] = self.tokenizer(literal, add_special_tokens=False)["input_ids"]
        return self._canonical[literal]

    def token_mask(self, token: int) -> Tensor:
        """Only `token`."""
        mask = torch.zeros(len(self.texts), dtype=torch.bool)
        mask[token] = True
        return mask

    def literal_mask(self, remaining: str, then_text: bool) -> Tensor:
        """Tokens that continue literal `remaining`; with `then_text`, also ones that run on into text."""
        key = (remaining, then_text)
        if key not in self._literal_masks:
            mask = torch.zeros(len(self.texts), dtype=torch.bool)
            for i, t in enumerate(self.texts):
                if not t or i == self.eos_id:
                    continue
                runs_on = then_text and t.startswith(remaining) and scan_text(t[len(remaining) :], False)
                mask[i] = remaining.startswith(t) or (
                    runs_on is not None and runs_on and runs_on[0] == "text"
                )
            self._literal_masks[key] = mask
        return self._literal_masks[key]

    def literal_only(self, remaining: str, then_text: bool) -> int | None:
        """The one token `literal_mask(remaining, then_text)` allows, None when it allows several."""
        key = (remaining, then_text)
        if key not in self._literal_only:
            ids = self.literal_mask(remaining, then_text).nonzero().flatten().tolist()
            self._literal_only[key] = ids[0] if len(ids) == 1 else None
        return self._literal_only[key]

    def sid_ids_of(self, sid: str) -> tuple[int, ...]:
        """Token ids of one SID string (`<a_1><b_2>...`); a clear error for anything else.

        The SID must be exactly its SID tokens: text around or between them (or no token at all)
        would be dropped here, and an empty SID would make the automaton index past its end.
        """
        parts = split_sid(sid) if isinstance(sid, str) else []
        if not parts or "".join(parts) != sid:
            raise ValueError(f"SID {sid!r} is not a run of SID tokens such as '<a_1><b_2><c_3><d_4>'")
        try:
            return tuple(self.vocab[t] for t in parts)
        except KeyError as err:
            raise ValueError(f"SID {sid!r}: token {err.args[0]} is not in the tokenizer") from None


def sid_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The ids of the tokenizer's SID-code tokens (`<a_12>`, one level of a SID each)."""
    return frozenset(i for t, i in tokenizer.get_vocab().items() if SID_TOKEN.fullmatch(t))


def list_key_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The tokens that write the ranking list's key (`LIST_KEY`) in the closing literal as the tokenizer
    writes it (ours: one token): once they are written, what follows is the ranking list."""
    ids = tokenizer(CLOSE, add_special_tokens=False)["input_ids"]
    spans = [(i, j) for i in range(len(ids)) for j in range(i + 1, len(ids) + 1)]
    key = [(j - i, i, j) for i, j in spans if LIST_KEY in tokenizer.decode(ids[i:j])]
    _, i, j = min(key)  # the shortest span that holds the whole word
    return tuple(ids[i:j])


def prompt_sids(tokens: GrammarTokens, prompt: Sequence[int], length: int) -> set[tuple[int, ...]]:
    """The SIDs of a prompt (token ids): its runs of exactly `length` SID tokens (history, candidates)."""
    out, run = set(), []
    for token in [*prompt, -1]:
        if token >= 0 and bool(tokens.sid_tokens[token]):
            run.append(int(token))
            continue
        if len(run) == length:
            out.add(tuple(run))
        run = []
    return out
