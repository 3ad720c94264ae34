"""GPU memory of each training stage on paper, for Qwen3-0.6B, 1.7B and 8B under DDP and FSDP.

    python benchmarks/memory_plan.py [--prompt-tokens 2200] [--response-tokens 160] [--gpu-gb 80]

Prints the Markdown table of docs/distributed.md ("Memory"). The model shapes are those of the
published Qwen3 ``config.json`` files. What it counts, per GPU:

* static: weights, gradients and AdamW moments kept in fp32 under bf16 autocast (4 + 4 + 8 = 16
  bytes a parameter, divided by the processes under FSDP's full shard, plus one decoder layer gathered
  in bf16 while it runs, or, for the stages that decode (ar_rl, OPD, RL), the whole model gathered in
  bf16 through each step: ``core/train/fsdp.py``); OPD adds its frozen AR teacher (fp32, on every GPU: it is not prepared, so
  never sharded) and its cached teacher logits.
* activations of one sequence (prompt + response) kept for the backward pass in bf16 with SDPA
  attention and no recomputation, layer by layer; CFT runs the prompt, the clean response and two
  noisy copies in one forward (prompt + 3 x response). The LM head's logits (bf16, their fp32 copy
  and its gradient: 10 bytes a vocabulary entry) for the response tokens the loss scores.

It is arithmetic, not a measurement: allocator slack, NCCL buffers and the CUDA context (~1-3 GB)
come on top, hence the headroom.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Shape:
    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool

    @property
    def layer_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (q + 2 * kv) + q * self.hidden + 2 * self.head_dim  # q/k norms
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * self.layer_params + self.hidden

    def activation_bytes_per_token(self) -> int:
        """Saved for backward, per token and layer: two fp32 norm inputs, the bf16 projections' inputs,
        q/k/v and the attention output, the MLP's gate, up, SiLU and down inputs."""
        q, kv, h, i = (
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.hidden,
            self.intermediate,
        )
        per_layer = 2 * 4 * h + 2 * 2 * h + 2 * (q + 2 * kv) + 2 * q + 4 * 2 * i
        return per_layer * self.layers


QWEN3 = (
    Shape("Qwen3-0.6B", 151_936, 1024, 28, 16, 8, 128, 3072, tied=True),
    Shape("Qwen3-1.7B", 151_936, 2048, 28, 16, 8, 128, 6144, tied=True),
    Shape("Qwen3-8B", 151_936, 4096, 36, 32, 8, 128, 12288, tied=False),
)


@dataclass(frozen=True)
class Stage:
    name: str
    response_copies: int  # response-sized segments in the training forward
    scored_copies: int  # response-sized segments whose logits the loss reads
    frozen_teacher: bool = False
    rollouts: bool = False  # decodes with the policy: under FSDP it holds the full weights a whole step


STAGES = (
    Stage("SFT (ar_sft)", 1, 1),
    Stage("RL (ar_rl)", 1, 1, rollouts=True),
    Stage("CFT", 3, 2),
    Stage("OPD", 2, 1, frozen_teacher=True, rollouts=True),  # replay canvases ~ one more response
    Stage("RL (rl)", 2, 1, rollouts=True),
)


def static_bytes(
    shape: Shape, stage: Stage, processes: int, sharded: bool, rows: int, response: int
) -> float:
    params = shape.params
    trained = 16 * params / (processes if sharded else 1)
    # in bf16: the layer running and the next, or every layer where the step decodes (core/train/fsdp.py)
    gathered = (2 * params if stage.rollouts else 2 * 2 * shape.layer_params) if sharded else 0
    teacher = 4 * params + rows * response * shape.vocab * 4 if stage.frozen_teacher else 0
    return trained + gathered + teacher


def sequence_bytes(shape: Shape, stage: Stage, prompt: int, response: int) -> float:
    tokens = prompt + stage.response_copies * response
    logits = stage.scored_copies * response * shape.vocab * 10
    return tokens * shape.activation_bytes_per_token() + logits


def fits(shape: Shape, stage: Stage, processes: int, sharded: bool, args: argparse.Namespace) -> int:
    """Sequences per micro-batch that fit one GPU (0: not even one)."""
    budget = args.gpu_gb * GB * (1 - args.headroom)
    static = static_bytes(shape, stage, processes, sharded, 1, args.response_tokens)
    per_row = sequence_bytes(shape, stage, args.prompt_tokens, args.response_tokens)
    return max(int((budget - static) // per_row), 0)


def fewest_gpus(shape: Shape, stage: Stage, args: argparse.Namespace) -> str:
    """The fewest GPUs that hold one sequence a GPU: 1 if the whole model fits, else FSDP over N."""
    if fits(shape, stage, 1, False, args):
        return "1"
    for n in (2, 4, 8, 16, 32, 64):
        if fits(shape, stage, n, True, args):
            return f"{n} (FSDP)"
    return "> 64"


def table(args: argparse.Namespace) -> list[str]:
    lines = [
        f"| model (params) | stage | static GB/GPU, DDP | static GB/GPU, FSDP x{args.processes} | "
        f"activations GB/sequence | sequences/GPU, DDP | sequences/GPU, FSDP x{args.processes} | fewest GPUs | "
        "config |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for shape in QWEN3:
        for stage in STAGES:
            ddp = static_bytes(shape, stage, 1, False, 1, args.response_tokens) / GB
            fsdp = static_bytes(shape, stage, args.processes, True, 1, args.response_tokens) / GB
            row = sequence_bytes(shape, stage, args.prompt_tokens, args.response_tokens) / GB
            on_ddp = fits(shape, stage, args.processes, False, args)
            on_fsdp = fits(shape, stage, args.processes, True, args)
            config = "ddp.yaml" if on_ddp else "fsdp.yaml" if on_fsdp else "does not fit"
            lines.append(
                f"| {shape.name} ({shape.params / 1e9:.2f}B) | {stage.name} | {ddp:.1f} | {fsdp:.1f} | {row:.1f} | "
                f"{on_ddp} | {on_fsdp} | {fewest_gpus(shape, stage, args)} | {config} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=2200, help="the paper's ~2,200-token prompts")
    parser.add_argument("--response-tokens", type=int, default=160, help="~130-token traces in blocks of 32")
    parser.add_argument("--gpu-gb", type=float, default=80.0)
    parser.add_argument("--processes", type=int, default=8, help="GPUs that share the FSDP shards")
    parser.add_argument("--headroom", type=float, default=0.1, help="left for the CUDA context and allocator")
    args = parser.parse_args()
    print("\n".join(table(args)))
    print(
        f"\nbytes per parameter: 16 trained (fp32 weights 4, gradients 4, AdamW 8) under DDP, 16/{args.processes} "
        f"under FSDP x{args.processes}; +4 for OPD's frozen fp32 teacher (on every GPU). Prompt "
        f"{args.prompt_tokens} + response {args.response_tokens} tokens a sequence; {args.gpu_gb:.0f} GB GPUs, "
        f"{args.headroom:.0%} headroom."
    )


if __name__ == "__main__":
    main()
