"""The copy mid-training task: every answer lists the prompt's candidates exactly once."""

from __future__ import annotations

import numpy as np
import pytest

from diffusion_gr2.core.text.midtraining import ANSWER_ORDERS, copy_answer_order, copy_task_examples
from diffusion_gr2.core.text.parser import parse_answer
from diffusion_gr2.core.text.tokenizer import ANSWER, decode_response
from tests.core.text.synthetic import make_sids


@pytest.mark.parametrize("answer_order", ANSWER_ORDERS)
def test_copy_task_answers_are_permutations_of_the_prompt_candidates(tokenizer, answer_order: str) -> None:
    sids = list(make_sids(40, seed=1)["sid"])
    frame = copy_task_examples(
        sids, tokenizer, n_examples=6, n_candidates=5, seed=3, answer_order=answer_order
    )
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
    again = copy_task_examples(
        sids, tokenizer, n_examples=6, n_candidates=5, seed=3, answer_order=answer_order
    )
    assert again.equals(frame)


def test_promote_order_is_one_candidate_first_then_prompt_order_without_it() -> None:
    rng = np.random.default_rng(0)
    promoted = set()
    for _ in range(50):
        order = copy_answer_order(rng, 6, "promote")
        promoted.add(order[0])
        assert sorted(order) == list(range(6))
        assert order[1:] == [i for i in range(6) if i != order[0]]
    assert promoted == set(range(6))  # every position gets promoted, the first included


def test_mixed_order_draws_both_shapes_and_unknown_orders_are_refused() -> None:
    rng = np.random.default_rng(0)
    orders = [copy_answer_order(rng, 8, "mixed") for _ in range(40)]
    promote_shaped = [o[1:] == [i for i in range(8) if i != o[0]] for o in orders]
    assert any(promote_shaped) and not all(promote_shaped)
    with pytest.raises(ValueError, match="answer_order"):
        copy_answer_order(rng, 8, "sorted")
