"""Prompt lookup: draft a row's next tokens from its own prompt and answer (prompt-lookup decoding).

Where the last n tokens written also occur earlier in the request (the prompt, or the answer so
far), the tokens that followed that earlier occurrence are a guess for what comes next; the decoder
feeds the guess and keeps what the model agrees with (`decoder.py`, drafts), so a wrong guess costs
compute, never a token. Our answers copy a lot from the prompt: SIDs, then the title and categories
that follow them there. The matching is that of prompt-lookup decoding (Saxena 2023, as in
`transformers`' `prompt_lookup_num_tokens`): the longest n-gram first (n = 3, 2, 1), its first
occurrence in the sequence whose continuation is not empty.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["MAX_NGRAM", "PromptLookup"]

MAX_NGRAM = 3  # the longest suffix matched; shorter ones are tried when it does not occur earlier


class PromptLookup:
    """An n-gram index of one request's tokens (prompt, then the answer as it is written).

    State: the tokens and, for every n-gram of up to `MAX_NGRAM` tokens, where its first occurrence
    ends; `extend` adds written tokens, so a lookup is a few dict reads however long the prompt is.
    """

    def __init__(self, prompt: Sequence[int]) -> None:
        self.tokens: list[int] = []
        self._after_first: dict[tuple[int, ...], int] = {}  # n-gram -> index just after its first occurrence
        self.extend(prompt)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append written tokens and index the n-grams they end."""
        for token in tokens:
            self.tokens.append(int(token))
            end = len(self.tokens)
            for n in range(1, min(MAX_NGRAM, end) + 1):
                self._after_first.setdefault(tuple(self.tokens[end - n : end]), end)

    def draft(self, extra: Sequence[int], m: int) -> list[int]:
        """Up to `m` tokens that followed the first earlier occurrence of the last n tokens of
        `tokens + extra` (`extra`: a draft being built, not written yet), longest n first; [] if none.

        An n-gram whose first occurrence is the sequence's own end has nothing after it: a shorter
        one is tried, as `transformers` skips an empty continuation.
        """
        tail = [*self.tokens[-MAX_NGRAM:], *extra][-MAX_NGRAM:]
        for n in range(len(tail), 0, -1):
            start = self._after_first.get(tuple(tail[-n:]))
            if start is not None and start < len(self.tokens):
                return self.tokens[start : start + m]
        return []
