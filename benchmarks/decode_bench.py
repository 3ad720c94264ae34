"""Decode throughput: our decoder (AR and block diffusion) vs `transformers` `generate`.

    .venv/bin/python benchmarks/decode_bench.py [--prompt-len 300] [--new-tokens 130] [--threads 2] [--device cuda]

One random Qwen3 of the default `ModelSpec` size, ~300-token prompts, ~130 output tokens, batch 1
and 16. Output tokens per second count generated tokens only (never prompt tokens). A random model is
not confident, so block decoding commits ~1 token per step; the "confident" rows scale its LM head so
that its top probabilities are near 1, which is what a converted-and-trained model looks like to the
commit rule. NFE = forward passes per sample (prefill included).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.decode.decoder import DecodeConfig, decode
from diffusion_gr2.core.model.factory import ModelSpec, build_model

MASK_ID = 1


def _tokenizer(size: int) -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "[MASK]": MASK_ID} | {f"w{i}": i for i in range(2, size)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>",
        mask_token="[MASK]",
    )


def _timed(fns: list[Callable[[], int]], repeats: int) -> list[tuple[float, int]]:
    """Best wall time of each `fn` and the output tokens it returned.

    The functions run interleaved (after one warm-up each) so that load from other processes on a
    shared machine hits them alike; the minimum is the least noisy estimate of the undisturbed time.
    """
    for fn in fns:
        fn()
    best, tokens = [float("inf")] * len(fns), [0] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            tokens[i] = fn()
            if torch.cuda.is_available():  # GPU work is asynchronous: wait for it before reading the clock
                torch.cuda.synchronize()
            best[i] = min(best[i], time.perf_counter() - start)
    return list(zip(best, tokens, strict=True))


def _ours(model: PreTrainedModel, prompts: list[list[int]], cfg: DecodeConfig) -> Callable[[], int]:
    def run() -> int:
        outs = decode(model, prompts, cfg)
        run.nfe = statistics.mean(o.nfe for o in outs)  # type: ignore[attr-defined]
        return sum(len(o.tokens) for o in outs)

    return run


def _hf(model: PreTrainedModel, prompts: list[list[int]], new_tokens: int) -> Callable[[], int]:
    ids = torch.tensor(prompts, device=model.device)  # equal lengths: no padding needed

    @torch.inference_mode()
    def run() -> int:
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
            use_cache=True,
        )
        run.tokens = out[:, ids.shape[1] :].tolist()  # type: ignore[attr-defined]
        return out[:, ids.shape[1] :].numel()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=130)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(ModelSpec(), _tokenizer(args.vocab)).to(args.device)
    gen = torch.Generator().manual_seed(0)
    all_prompts = torch.randint(2, args.vocab, (16, args.prompt_len), generator=gen).tolist()
    n_params = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"model {n_params:.2f}M params, prompt {args.prompt_len}, new tokens {args.new_tokens}, "
        f"device {args.device}, threads {args.threads}"
    )
    print(f"{'system':34s} {'batch':>5s} {'tok/s':>8s} {'NFE/sample':>10s} {'tok/fwd':>8s}")
    ar = DecodeConfig(max_new_tokens=args.new_tokens, batch_size=16)
    for batch in (1, 16):
        prompts = all_prompts[:batch]
        hf, ours = _hf(model, prompts, args.new_tokens), _ours(model, prompts, ar)
        (t_hf, n_hf), (t_ours, n_ours) = _timed([hf, ours], args.repeats)
        assert [o.tokens for o in decode(model, prompts, ar)] == hf.tokens, "AR decoder must equal generate"
        _row("transformers generate (greedy, cache)", batch, n_hf / t_hf, float(args.new_tokens))
        _row("ours AR (B=1)", batch, n_ours / t_ours, ours.nfe, n_ours / batch)
    _block_rows(model, all_prompts, ar, args.repeats, "random")
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # tied: scales the embedding too; makes predictions peaked
    _block_rows(model, all_prompts, ar, args.repeats, "confident")


def _block_rows(
    model: PreTrainedModel, all_prompts: list[list[int]], ar: DecodeConfig, repeats: int, label: str
) -> None:
    for k in (16, 32):
        for batch in (1, 16):
            cfg = dataclasses.replace(ar, block_size=k, threshold=0.9, mask_token_id=MASK_ID)
            ours = _ours(model, all_prompts[:batch], cfg)
            ((t, n),) = _timed([ours], repeats)
            _row(f"ours block B={k} tau=0.9 ({label})", batch, n / t, ours.nfe, n / batch)


def _row(name: str, batch: int, tok_s: float, nfe: float, tokens_per_sample: float | None = None) -> None:
    per_fwd = (tokens_per_sample or nfe) / nfe
    print(f"{name:34s} {batch:5d} {tok_s:8.1f} {nfe:10.1f} {per_fwd:8.2f}")


if __name__ == "__main__":
    main()
