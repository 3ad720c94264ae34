"""The copy mid-training task: every answer lists the prompt's candidates exactly once."""

from __future__ import annotations

from diffusion_gr2.core.text.midtraining import copy_task_examples
from diffusion_gr2.core.text.parser import parse_answer
from diffusion_gr2.core.text.tokenizer import ANSWER, decode_response
from tests.core.text.synthetic import make_sids


def test_copy_task_answers_are_permutations_of_the_prompt_candidates(tokenizer) -> None:
    sids = list(make_sids(40, seed=1)["sid"])
    frame = copy_task_examples(sids, tokenizer, n_examples=6, n_candidates=5, seed=3)
    assert len(frame) == 6
    for prompt, response, roles in frame.itertuples(index=False):
        prompt_text = tokenizer.decode(prompt)
        candidates = [s for s in sids if s in prompt_text]
        assert len(candidates) == 5
        answer = decode_response(tokenizer, response).replace(
            '{"recommendations"', '{"explanation":"","recommendations"'
        )
        parsed = parse_answer(answer, candidates)
        assert parsed.valid, parsed.reason
        assert all(r == ANSWER for r in roles)
    again = copy_task_examples(sids, tokenizer, n_examples=6, n_candidates=5, seed=3)
    assert again.equals(frame)
