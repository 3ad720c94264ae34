"""Grammar-constrained decoding of ranking answers: only permutations of the request's candidates.

Generative recommenders constrain decoding to valid item ids (TIGER's prefix-tree beam search); this
is the same idea for a whole GR2 answer. `AnswerGrammar` is a per-request token automaton that accepts
exactly

    {"explanation":"<JSON string text>","recommendations":["<sid>","<sid>",...]}<|im_end|>

where the SIDs are a permutation of the request's candidates: the compact format every trace is
written in (`render_answer`). The explanation is free text (any token that keeps it a valid JSON
string, escapes included; SID tokens may be cited); everything after it is forced structure plus a
choice among the candidates not ranked yet. With `cited` (the SIDs of the request's prompt: its
history and candidates, `prompt_sids`) an explanation may cite only those, whole: once a SID's first
tokens pin one of them, the rest is forced (written by jump-forward like a ranked SID's). When the
token budget gets tight the explanation is closed and the literals take their canonical tokens, so a
long explanation cannot crowd the ranking out of `max_new_tokens`.

The automaton's states are here; the literals and the per-tokenizer tables it reads (`GrammarTokens`:
token texts, the explanation's masks, the SID tokens), shared by every request, are in
`grammar_tokens.py`.

The decoder (`decode(..., constraints=...)`) asks `allowed(budget)` before committing a token and
calls `advance(token)` after; see `decoder.py` for how it counts the answers the grammar corrected.
`only(budget)` names the token when the grammar leaves exactly one (the rest of a SID its first
tokens pinned, the last candidate, the end token): the decoder writes those without waiting for the
model's confidence (`DecodeConfig.jump_forward`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from diffusion_gr2.core.decode.grammar_tokens import (
    CLOSE,
    END,
    OPEN,
    SEPARATOR,
    GrammarTokens,
    prompt_sids,
    scan_text,
)

__all__ = ["AnswerGrammar", "TokenConstraint", "accepts", "allowed_masks", "answer_grammars"]


class TokenConstraint(Protocol):
    """What the decoder needs from a constraint on one row's output."""

    def allowed(self, budget: int) -> Tensor | None:
        """bool [v]: tokens allowed next, with `budget` tokens left for the row; None = any token."""
        ...

    def advance(self, token: int) -> None:
        """Consume one committed token (it must be allowed)."""
        ...

    def only(self, budget: int) -> int | None:
        """The one token allowed next when there is exactly one (None: several, or any).

        Cheap by contract (no tensor work): the decoder asks it at every position it may commit,
        and writes such a token without the model's say (`DecodeConfig.jump_forward`).
        """
        ...

    def copy(self) -> TokenConstraint:
        """An independent copy in the same state."""
        ...


class AnswerGrammar:
    """Token automaton of one request's answer (module doc); phases: literal, text, sid, eos, done."""

    def __init__(
        self,
        tokens: GrammarTokens,
        candidate_sids: Sequence[str],
        cited: Iterable[Sequence[int]] | None = None,
    ) -> None:
        """`cited`: the SIDs (token ids) the explanation may cite, the candidates always among them;
        None = any SID tokens, in any order (module doc)."""
        if not candidate_sids:
            raise ValueError("a ranking grammar needs at least one candidate SID")
        self.tokens = tokens
        self.remaining = [tokens.sid_ids_of(s) for s in candidate_sids]  # checks each SID's form
        repeated = sorted({s for s in candidate_sids if list(candidate_sids).count(s) > 1})
        if repeated:
            raise ValueError(f"duplicate candidate SIDs {repeated} in {list(candidate_sids)}")
        lengths = {len(s) for s in self.remaining}
        if len(lengths) != 1:  # equal lengths make the SID set prefix-free: a full match ends a SID
            raise ValueError(f"candidate SIDs differ in token length: {list(candidate_sids)}")
        self.sid_length = lengths.pop()
        self.phase, self.literal, self.then = "literal", OPEN, "text"
        self.escaped = False  # inside the explanation: a backslash is pending
        self.partial: tuple[int, ...] = ()  # SID tokens written of the current item
        self.cited = None if cited is None else frozenset(map(tuple, cited)) | frozenset(self.remaining)
        if self.cited is not None and any(len(c) != self.sid_length for c in self.cited):
            raise ValueError(f"cited SIDs must have the candidates' {self.sid_length} tokens")
        self.citing: tuple[int, ...] = ()  # explanation: SID tokens written of the current citation
        self._cite_masks: dict[tuple[int, ...], Tensor] = {}  # citation prefix -> next tokens (shared)
        # Tokens the answer needs after the explanation (canonical literals), plus slack for a closing
        # quote the model splits off: below this budget the explanation must close.
        self.reserve = len(tokens.canonical_ids(CLOSE)) + self._list_cost(len(self.remaining)) + 2

    def copy(self) -> AnswerGrammar:
        clone = copy.copy(self)  # shares the token tables
        clone.remaining = list(self.remaining)
        return clone

    def _list_cost(self, items: int) -> int:
        """Tokens that `items` more SIDs need, with their separators, the closing `"]}` and the eos."""
        sep, end = len(self.tokens.canonical_ids(SEPARATOR)), len(self.tokens.canonical_ids(END))
        return items * self.sid_length - len(self.partial) + max(items - 1, 0) * sep + end + 1

    def _needed(self) -> int:
        """Tokens needed to finish from a literal phase, canonically written."""
        after = {"text": self.reserve - 2, "sid": self._list_cost(len(self.remaining)), "eos": 1}[self.then]
        return len(self.tokens.canonical_ids(self.literal)) + after

    def allowed(self, budget: int) -> Tensor | None:
        t = self.tokens
        if self.phase == "literal":
            if budget <= self._needed():  # no room for detours: the literal's canonical next token
                return t.token_mask(t.canonical_ids(self.literal)[0])
            return t.literal_mask(self.literal, self.then == "text")
        if self.phase == "text":
            if self.citing:  # inside a citation: the rest of a cited SID
                return self._cite_mask(self.citing)
            if budget <= self.reserve and not self.escaped:  # close now, or the ranking will not fit
                return t.close_masks[False]
            if self.cited is None or self.escaped:
                return t.text_masks[self.escaped]
            # a SID token only as a cited SID's first, and only where the whole SID still fits
            starts = budget >= self.reserve + self.sid_length
            return self._cite_mask(() if starts else None)
        if self.phase == "sid":
            mask = torch.zeros(len(t.texts), dtype=torch.bool)
            depth = len(self.partial)
            mask[[s[depth] for s in self.remaining if s[:depth] == self.partial]] = True
            return mask
        if self.phase == "eos":
            mask = torch.zeros(len(t.texts), dtype=torch.bool)
            mask[t.eos_id] = True
            return mask
        return None  # done: the row has ended; later positions never reach the output

    def only(self, budget: int) -> int | None:
        """The forced token, if any: mirrors `allowed` without building a mask (the decoder's fast path)."""
        t = self.tokens
        if self.phase == "literal":
            if budget <= self._needed():
                return t.canonical_ids(self.literal)[0]
            return t.literal_only(self.literal, self.then == "text")
        if self.phase == "sid":  # the last candidate left, or the SID already pinned by its prefix
            depth = len(self.partial)
            options = {s[depth] for s in self.remaining if s[:depth] == self.partial}
            return next(iter(options)) if len(options) == 1 else None
        if self.phase == "eos":
            return t.eos_id
        if self.phase == "text" and self.citing:  # a citation its first tokens pinned
            depth = len(self.citing)
            options = {s[depth] for s in self.cited or () if s[:depth] == self.citing}
            return next(iter(options)) if len(options) == 1 else None
        return None  # explanation text always has several continuations; done: any token

    def advance(self, token: int) -> None:
        t = self.tokens
        if self.phase == "literal":
            text = t.texts[token]
            if self.literal.startswith(text):
                self.literal = self.literal[len(text) :]
                if not self.literal:
                    self._enter(self.then)
                return
            if self.then == "text" and text.startswith(self.literal):
                self.phase, self.escaped = "text", False
                self._text(token, text[len(self.literal) :])
                return
            raise ValueError(f"token {token} ({text!r}) does not continue literal {self.literal!r}")
        if self.phase == "text":
            if self.cited is not None and (self.citing or bool(t.sid_tokens[token])):
                self.citing += (token,)
                if self.citing not in self._cite_prefixes():
                    raise ValueError(f"SID tokens {self.citing} cite no SID of the request's prompt")
                if len(self.citing) == self.sid_length:
                    self.citing = ()
            self._text(token, None)
        elif self.phase == "sid":
            self.partial += (token,)
            if len(self.partial) == self.sid_length:
                self.remaining.remove(self.partial)  # ValueError for a SID that is not left
                self.partial = ()
                self.phase, self.literal = "literal", SEPARATOR if self.remaining else END
                self.then = "sid" if self.remaining else "eos"
        elif self.phase == "eos":
            if token != t.eos_id:
                raise ValueError(f"token {token} after a complete answer; expected end-of-output")
            self.phase = "done"

    def _cite_prefixes(self) -> frozenset[tuple[int, ...]]:
        """Every prefix of a cited SID (built once per request; copies share it)."""
        if "_prefixes" not in self.__dict__:
            self._prefixes = frozenset(c[:d] for c in self.cited or () for d in range(1, self.sid_length + 1))
        return self._prefixes

    def _cite_mask(self, prefix: tuple[int, ...] | None) -> Tensor:
        """Inside a citation (`prefix` non-empty): the next tokens of cited SIDs. Otherwise the
        explanation's text tokens, SID tokens only where they start a cited SID (none: `prefix` None)."""
        key = (-1,) if prefix is None else prefix
        if key not in self._cite_masks:
            t = self.tokens
            depth = 0 if prefix is None else len(prefix)
            nxt = [c[depth] for c in self.cited or () if prefix is not None and c[:depth] == prefix]
            mask = torch.zeros(len(t.texts), dtype=torch.bool)
            mask[nxt] = True
            if not prefix:
                mask |= t.text_masks[False] & ~t.sid_tokens
            self._cite_masks[key] = mask
        return self._cite_masks[key]

    def _text(self, token: int, run_on: str | None) -> None:
        """Consume explanation text: the whole token, or `run_on` (its part after a literal)."""
        effect = (
            scan_text(run_on, False)
            if run_on is not None
            else self.tokens.text_effects.get((self.escaped, token))
        )
        if effect is None:
            raise ValueError(f"token {token} ({self.tokens.texts[token]!r}) cannot continue the explanation")
        kind, value = effect
        if kind == "text":
            self.escaped = bool(value)
            return
        self.phase, self.literal, self.then = "literal", CLOSE[int(value) :], "sid"
        if not self.literal:
            self._enter("sid")

    def _enter(self, phase: str) -> None:
        self.phase = phase
        if phase == "text":
            self.escaped = False


def allowed_masks(
    constraint: TokenConstraint, tokens: Sequence[int], max_new_tokens: int, vocab: int
) -> Tensor:
    """bool [len(tokens), vocab]: what `constraint` allowed at each position of a decoded output.

    The constraint is a function of the tokens before a position and the budget left there, so
    walking a copy over the output rebuilds exactly the masks the decoder applied (RL needs them to
    score the constrained policy it sampled from).
    """
    state, rows = constraint.copy(), []
    for n, token in enumerate(tokens):
        allowed = state.allowed(max_new_tokens - n)
        rows.append(torch.ones(vocab, dtype=torch.bool) if allowed is None else allowed)
        state.advance(int(token))
    return torch.stack(rows) if rows else torch.ones(0, vocab, dtype=torch.bool)


def accepts(constraint: TokenConstraint, tokens: Sequence[int], max_new_tokens: int) -> bool:
    """Whether `constraint` allows every token of an output decoded without it (budgets as the decoder's).

    A free output it accepts is exactly what constrained decoding without jump-forward writes with
    no correction: the model's own answer, one the grammar never had to touch.
    """
    state = constraint.copy()
    for n, token in enumerate(tokens):
        allowed = state.allowed(max_new_tokens - n)
        if allowed is not None and not bool(allowed[int(token)]):
            return False
        state.advance(int(token))
    return True


def answer_grammars(
    tokenizer: PreTrainedTokenizerBase,
    candidate_lists: Sequence[Sequence[str]],
    eos_token: str,
    prompts: Sequence[Sequence[int]] | None = None,
) -> list[AnswerGrammar]:
    """One `AnswerGrammar` per request's candidate SIDs, sharing one `GrammarTokens` table; with
    `prompts` (token ids, one per request) its explanation cites only the prompt's SIDs."""
    tokens = GrammarTokens.from_tokenizer(tokenizer, eos_token)
    if prompts is None:
        return [AnswerGrammar(tokens, sids) for sids in candidate_lists]
    out = []
    for sids, prompt in zip(candidate_lists, prompts, strict=True):
        length = len(tokens.sid_ids_of(sids[0])) if sids else 0
        out.append(AnswerGrammar(tokens, sids, prompt_sids(tokens, prompt, length)))
    return out
