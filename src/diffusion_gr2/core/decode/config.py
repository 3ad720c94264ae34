"""What the decoder is asked (`DecodeConfig`), what it returns (`DecodeOutput`), and the refusals.

`check` is the one place that refuses a setting the decoder cannot honour; each drafter states the
exactness it promises (`drafters.py`) and is admitted only where that promise holds: the lossless
drafts (`draft`) in greedy AR decoding, the lossy copy drafts (`copy_drafts`) in block diffusion.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedModel

__all__ = ["BACKENDS", "COMMIT_RULES", "DRAFTS", "DecodeConfig", "DecodeOutput", "check"]

# `prefix` (default): the leftmost masked position plus the unbroken run above tau after it;
# `confident`: Fast-dLLM v2's rule, kept for the comparison of docs/experiments.md#commit-rule.
COMMIT_RULES = ("prefix", "confident")
BACKENDS = ("auto", "lean", "eager")
DRAFTS = (None, "prompt", "model")  # the lossless drafters of `DecodeConfig.draft`


@dataclass(frozen=True)
class DecodeConfig:
    """How to decode; the defaults are greedy AR decoding, with conf/base's `inference.decoding` values
    for the settings both name (tests/test_config.py holds them equal)."""

    block_size: int = 1  # k; 1 = autoregressive
    threshold: float = 0.9  # tau: commit masked positions whose probability exceeds it (Fast-dLLM v2)
    commit_rule: str = "prefix"  # which masked positions a step commits: COMMIT_RULES, `commit.py`
    max_new_tokens: int = 192  # per row, end-of-output token included
    max_steps_per_block: int | None = None  # None -> block_size (k - 1 steps always suffice)
    do_sample: bool = False  # False = arg-max
    temperature: float = 1.0  # only when sampling
    eos_token_ids: tuple[int, ...] = ()  # end-of-output tokens (`<|im_end|>`)
    mask_token_id: int | None = None  # required for block_size > 1
    pad_token_id: int = 0  # left padding of prompts (never attended to)
    batch_size: int = 32  # rows decoded together
    seed: int = 0  # sampling generator
    recompute: bool = False  # the reference runner: no KV cache, the whole sequence re-run every step
    # A finished block's keys/values are written in the same forward as the next block's first step
    # (its canvas then still has position 0 masked); False = one extra forward per block for it.
    fused: bool = True
    # Masked positions of a block each step feeds, from the leftmost masked one (None = the whole
    # block): positions right of the window are not computed at all (`commit.fed_width`).
    window: int | None = None
    # The model's forward: "lean" (core/model/lean.py: the same arithmetic in a few tensor ops, ~2x
    # faster a step on the default model; Qwen3 only), "eager" (the transformers modules, the
    # reference) or "auto" (lean where it covers the model, e.g. not the pretrained SmolLM2).
    backend: str = "auto"
    # Jump-forward (constrained decoding only): a position the constraint leaves one token is written
    # without the model's say. Diffusion: such positions join the step's run as certain. AR: when
    # every row's next token is forced, it is written without a forward and fed with the next one.
    jump_forward: bool = True
    # Lossless drafts, AR greedy decoding only (`drafters.py`): tokens guessed ahead and verified in
    # one forward, so the tokens of plain decoding in fewer forwards. "prompt" = prompt lookup
    # (`LookupDrafter`), "model" = a block-diffusion drafter model (`ModelDrafter`,
    # `decode(..., drafter=...)`); None = none.
    draft: str | None = None
    # Lossy copy drafts, block diffusion only (`CopyDrafter`): prompt lookup's continuations of the
    # committed text fed into the block's masked positions as tokens, committed where the model's own
    # token agrees. Other tokens than plain decoding: chosen on validation
    # (docs/experiments.md#copy-drafts).
    copy_drafts: bool = False
    # Draft tokens fed per forward at most, either kind (transformers' prompt_lookup_num_tokens; for
    # "model" the drafter's canvas, at most its block size). 3: on ar_rl (20 test prompts, batch 1) a fourth
    # prompt-lookup token was kept in 2% (free) / 6% (grammar) of the drafts that had one, and a CPU
    # forward's cost grows with its width (4 tokens ~1.3x one, 11 ~2x).
    draft_tokens: int = 3
    # Block diffusion: a position whose chosen token is a SID code (`sid_token_ids`) commits only above
    # this tau instead (None = `threshold` everywhere). SID codes are where parallel commits break an
    # answer (a foreign or repeated ID); the free text around them is safe at a lower tau. None here
    # (conf's 0.99 is RerankConfig's default): the gate needs `sid_token_ids`, which only a tokenizer
    # names, and `decode_config_for` sets both.
    sid_threshold: float | None = None
    sid_token_ids: frozenset[int] = frozenset()
    # The SID threshold holds only after this token sequence (the ranking list's key,
    # `grammar_tokens.list_key_ids`): the explanation's cited SIDs keep `threshold`. Empty = everywhere.
    sid_after: tuple[int, ...] = ()
    # Block diffusion: a choice equal to its left neighbour's, both masked when the forward ran, does
    # not join the step's parallel commits (`commit.repeat_gated`): a repeat committed in parallel is
    # where free answers stutter.
    repeat_gate: bool = True
    # The static step (`static.py`): a KV cache allocated once for the prompt and the longest answer,
    # attention over all of it under a key mask, a fixed query width per step kind; the same tokens
    # (tests/core/decode/test_static.py). Opt-in: on the CPU it is slower (it attends to dead keys).
    static_cache: bool = False
    # With `static_cache`, on CUDA: each (rows, width) step captured once as a CUDA graph and replayed
    # (elsewhere the static step runs eagerly). Unmeasured until a GPU is lent (issue 45).
    cuda_graphs: bool = False


@dataclass(frozen=True)
class DecodeOutput:
    """One decoded row. Lists are aligned with `tokens`, which end with (and include) the eos token."""

    tokens: list[int]
    commit_steps: list[int]  # step inside its block (block's first token = 0, first forward = 1, ...)
    nfe: int  # forward passes this row needed (prefill included)
    token_logprobs: list[float]  # log-prob under the distribution the token was committed from
    # Canvas of the final block after the last output token (MASK where never committed) and its
    # commit steps (-1 = never). Tokens committed there were visible to later commits; replay needs them.
    tail_tokens: list[int] = field(default_factory=list)
    tail_steps: list[int] = field(default_factory=list)
    # Overrides by the constraint: tokens replaced or jumped where the model chose another, and runs
    # ended at a disallowed choice. 0 = the unconstrained output token for token, except diffusion
    # with jump-forward (there: only the model's own choices committed; decoder.py)
    forced: int = 0


def check(
    config: DecodeConfig, prompts: int, constraints: int | None, drafter: PreTrainedModel | None
) -> None:
    """Refuse a config (or a constraint count, a drafter) the decoder cannot honour, with the reason."""
    if config.block_size > 1 and config.mask_token_id is None:
        raise ValueError("block_size > 1 needs mask_token_id")
    if config.window is not None and config.window < 1:
        raise ValueError(f"window must be >= 1 (or None for the whole block), got {config.window}")
    if config.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {config.backend!r}")
    if config.commit_rule not in COMMIT_RULES:
        raise ValueError(f"commit_rule must be one of {COMMIT_RULES}, got {config.commit_rule!r}")
    _check_drafts(config, drafter)
    _check_static(config)
    if constraints is not None:
        if constraints != prompts:
            raise ValueError(f"{prompts} prompts but {constraints} constraints")
        if config.block_size > 1 and config.commit_rule != "prefix":
            raise ValueError(
                "constrained decoding needs commit_rule='prefix' (a constraint reads the committed "
                f"tokens left of the one it checks), got {config.commit_rule!r}"
            )


def _check_drafts(config: DecodeConfig, drafter: PreTrainedModel | None) -> None:
    """Each draft mechanism where its promise holds: the lossless ones (`draft`, AR verification:
    prompt lookup, a drafter model) only in greedy AR decoding, where the model's own token decides
    every position; the lossy one (`copy_drafts`, block diffusion) only under the `prefix` rule, whose
    run is what a draft the model leaves can end."""
    if config.draft not in DRAFTS:
        raise ValueError(f"draft must be one of {DRAFTS}, got {config.draft!r}")
    if config.draft is not None and not (
        config.block_size == 1 and not config.do_sample and config.draft_tokens >= 1
    ):
        raise ValueError(
            "lossless drafts (draft 'prompt' or 'model') need AR greedy decoding (block_size 1, "
            f"do_sample False) and draft_tokens >= 1; got block_size {config.block_size}, do_sample "
            f"{config.do_sample}, draft {config.draft!r}, draft_tokens {config.draft_tokens} (block "
            "diffusion's drafts are the lossy copy_drafts)"
        )
    if config.copy_drafts and not (config.block_size > 1 and config.commit_rule == "prefix"):
        raise ValueError(
            "lossy copy drafts (copy_drafts) need block diffusion (block_size > 1) under commit_rule "
            f"'prefix'; got block_size {config.block_size}, commit_rule {config.commit_rule!r}"
        )
    if (config.draft == "model") != (drafter is not None):
        raise ValueError(
            f"a drafter model goes with draft 'model' and only with it, got draft {config.draft!r}"
        )
    if drafter is not None:
        block = getattr(drafter.config, "block_size", None)
        if block is None or (
            config.mask_token_id is None and getattr(drafter.config, "mask_token_id", None) is None
        ):
            raise ValueError(
                "the drafter must be a block-diffusion model (config.block_size and mask_token_id)"
            )
        if config.draft_tokens > int(block):
            raise ValueError(f"draft_tokens {config.draft_tokens} exceeds the drafter's block size {block}")


def _check_static(config: DecodeConfig) -> None:
    """The static step (`static.py`) where it is built: the lean forward, with a cache (every
    feature of the cached runner runs there: windows, drafts of either kind, the grammar)."""
    if config.cuda_graphs and not config.static_cache:
        raise ValueError("cuda_graphs captures the static step: it needs static_cache")
    if not config.static_cache:
        return
    refused = {
        "recompute (the reference runner has no cache to make static)": config.recompute,
        "backend 'eager' (the static step runs the lean forward, core/model/lean.py)": config.backend
        == "eager",
    }
    named = [what for what, on in refused.items() if on]
    if named:
        raise ValueError("static_cache does not support " + ", ".join(named))
