"""Decode throughput: our decoder (AR and block diffusion) vs `transformers` `generate`.

    .venv/bin/python benchmarks/decode_bench.py [--prompt-len 300] [--new-tokens 130] [--threads 2]
        [--device cuda] [--rounds 5] [--block-sizes 16 32]

One random Qwen3 of the default `ModelSpec` size, ~300-token prompts, ~130 output tokens, batch 1
and 16. Output tokens per second count generated tokens only (never prompt tokens). A random model is
not confident, so block decoding commits ~1 token per step; the "confident" rows scale a copy's LM
head so that its top probabilities are near 1, which is what a converted-and-trained model looks
like to the commit rule. NFE = forward passes per sample (prefill included).

Timed with the one harness (`core/bench/harness.py`): at each batch size every row is one system,
all interleaved over `--rounds` rounds after a warm-up call each, full batches cycling 16 prompts;
tokens/s is the median over rounds, and each row's speed-up against our AR decoder is paired by
round, with its sign-test interval (the statistic is printed above the table).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.base.speed import statistic
from diffusion_gr2.core.bench.harness import TimedSystem, round_rates, table_row, time_rounds
from diffusion_gr2.core.decode.decoder import DecodeConfig, decode
from diffusion_gr2.core.model.factory import ModelSpec, build_model

MASK_ID = 1
AR = "ours AR (B=1)"  # the row every speed-up is against


def _tokenizer(size: int) -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "[MASK]": MASK_ID} | {f"w{i}": i for i in range(2, size)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>",
        mask_token="[MASK]",
    )


def _sync() -> None:
    if torch.cuda.is_available():  # GPU work is asynchronous: wait for it before reading the clock
        torch.cuda.synchronize()


def _ours(model: PreTrainedModel, cfg: DecodeConfig) -> TimedSystem[list[int]]:
    def run(batch: list[list[int]]) -> list[tuple[int, int]]:
        return [(len(o.tokens), o.nfe) for o in decode(model, batch, cfg)]

    return TimedSystem(run, cfg.batch_size, _sync)


@torch.inference_mode()
def _generated(model: PreTrainedModel, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    ids = torch.tensor(batch, device=model.device)  # equal lengths: no padding needed
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
        use_cache=True,
    )
    return out[:, ids.shape[1] :].tolist()


def _hf(model: PreTrainedModel, batch_size: int, new_tokens: int) -> TimedSystem[list[int]]:
    def run(batch: list[list[int]]) -> list[tuple[int, int]]:
        return [(len(t), len(t)) for t in _generated(model, batch, new_tokens)]  # one forward a token

    return TimedSystem(run, batch_size, _sync)


def _systems(
    model: PreTrainedModel, confident: PreTrainedModel, batch: int, args: argparse.Namespace
) -> dict[str, TimedSystem[list[int]]]:
    """Every row at batch size `batch`: `generate`, our AR decoder, block decoding per block size."""
    ar = DecodeConfig(max_new_tokens=args.new_tokens, batch_size=batch)
    systems = {
        "transformers generate (greedy, cache)": _hf(model, batch, args.new_tokens),
        AR: _ours(model, ar),
    }
    for label, m in (("random", model), ("confident", confident)):
        for k in args.block_sizes:
            cfg = dataclasses.replace(ar, block_size=k, threshold=0.9, mask_token_id=MASK_ID)
            systems[f"ours block B={k} tau=0.9 ({label})"] = _ours(m, cfg)
    return systems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=130)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--rounds", "--repeats", dest="rounds", type=int, default=5, help="interleaved rounds"
    )
    parser.add_argument("--block-sizes", nargs="+", type=int, default=[16, 32])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(ModelSpec(), _tokenizer(args.vocab)).to(args.device)
    confident = copy.deepcopy(model)
    with torch.no_grad():
        confident.lm_head.weight.mul_(30.0)  # tied: scales the embedding too; makes predictions peaked
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, args.vocab, (16, args.prompt_len), generator=gen).tolist()
    n_params = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"model {n_params:.2f}M params, prompt {args.prompt_len}, new tokens {args.new_tokens}, "
        f"device {args.device}, threads {args.threads}; tokens/s: {statistic(args.rounds)}"
    )
    print(
        f"{'system':34s} {'batch':>5s} {'tok/s':>8s} {'NFE/sample':>10s} {'tok/fwd':>8s}  vs ours AR [interval]"
    )
    for batch in (1, 16):
        ar = DecodeConfig(max_new_tokens=args.new_tokens, batch_size=batch)
        ours = [o.tokens for o in decode(model, prompts[:batch], ar)]
        assert ours == _generated(model, prompts[:batch], args.new_tokens), "AR decoder must equal generate"
        timed = time_rounds(_systems(model, confident, batch, args), prompts, args.rounds)
        reference = round_rates(timed[AR])
        for name, rounds in timed.items():
            print(table_row(name, rounds, reference, str(batch)))


if __name__ == "__main__":
    main()
