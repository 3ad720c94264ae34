"""The shared training loop: exact resume after a crash, checkpoint hygiene, schedule, logging."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from diffusion_gr2.core.train.checkpoint import checkpoint_dirs, latest_checkpoint
from diffusion_gr2.core.train.loop import TrainConfig, _lr_factor, move_to, seed_everything, train

torch.set_num_threads(1)


class _Crash(RuntimeError):
    """Raised by the test loss to simulate a process killed mid-run."""


def _mlp(seed: int) -> torch.nn.Module:
    """Tiny net with dropout, so the loss also draws from the global RNG that resume must restore."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8),
        torch.nn.Tanh(),
        torch.nn.Dropout(0.2),
        torch.nn.LayerNorm(8),
        torch.nn.Linear(8, 1),
    )


def _make_batch(index: int, model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + index)
    x = torch.randn(6, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def _mse_loss(crash_at: int | None = None):
    calls = {"n": 0}

    def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
        calls["n"] += 1
        if crash_at is not None and calls["n"] == crash_at:
            raise _Crash(f"killed at call {crash_at}")
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        return loss, {"mse": loss.item()}

    return loss_fn


def _config(tmp_path: Path, **kw) -> TrainConfig:
    base = TrainConfig(
        output_dir=str(tmp_path), lr=3e-2, weight_decay=0.01, max_steps=10, warmup_steps=2,
        checkpoint_every=3, log_every=2, seed=7, cpu=True, progress=False,
    )  # fmt: skip
    return replace(base, **kw)


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_crash_then_resume_equals_uninterrupted_run(tmp_path: Path) -> None:
    ref_model = _mlp(0)
    ref = train(ref_model, _make_batch, _mse_loss(), _config(tmp_path / "ref"))
    assert ref.steps == 10 and ref.resumed_from is None and len(ref.history) == 10

    crashed = _mlp(0)
    cfg = _config(tmp_path / "run")
    with pytest.raises(_Crash):  # dies during step 8: checkpoints exist for steps 3 and 6
        train(crashed, _make_batch, _mse_loss(crash_at=8), cfg)
    assert [s for s, _ in checkpoint_dirs(tmp_path / "run" / "checkpoints")] == [3, 6]

    resumed_model = _mlp(123)  # a different init: everything must come from the checkpoint
    resumed = train(resumed_model, _make_batch, _mse_loss(), cfg)
    assert resumed.resumed_from == 6
    _assert_same_weights(resumed_model, ref_model)
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in ref.history]
    assert resumed.final_metrics == ref.final_metrics

    at_end = train(_mlp(5), _make_batch, _mse_loss(), cfg)  # resumes at its final checkpoint: no step
    assert at_end.resumed_from == 10 and at_end.final_metrics == ref.final_metrics
    assert at_end.seconds == pytest.approx(resumed.seconds) and at_end.seconds > 0  # steps before the resume


def test_weights_actually_change_and_loss_falls(tmp_path: Path) -> None:
    model = _mlp(0)
    before = [p.detach().clone() for p in model.parameters()]
    result = train(model, _make_batch, _mse_loss(), _config(tmp_path, max_steps=30, checkpoint_every=0))
    assert not any(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    first, last = result.history[0]["loss"], sum(h["loss"] for h in result.history[-5:]) / 5
    assert last < first
    assert not (tmp_path / "checkpoints").exists()  # checkpoint_every=0 writes nothing


def test_checkpoints_are_pruned_and_temp_dirs_ignored(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    (root / ".step-000099.tmp").mkdir(parents=True)  # a crashed write: never a resume candidate
    cfg = _config(tmp_path, max_steps=7, checkpoint_every=2, keep_checkpoints=2, resume=False)
    train(_mlp(0), _make_batch, _mse_loss(), cfg)
    assert [s for s, _ in checkpoint_dirs(root)] == [6, 7]  # final step always saved, 2 kept
    assert latest_checkpoint(root) == root / "step-000007"
    files = {p.name for p in (root / "step-000007").iterdir()}
    assert {
        "model.safetensors",
        "optimizer.bin",
        "scheduler.bin",
        "random_states_0.pkl",
        "trainer_state.json",
    } <= files
    again = train(_mlp(0), _make_batch, _mse_loss(), cfg)  # resume=False starts over
    assert again.resumed_from is None and len(again.history) == 7
    done = train(_mlp(0), _make_batch, _mse_loss(), replace(cfg, resume=True))  # nothing left to do
    assert done.resumed_from == 7 and done.final_metrics == again.final_metrics


def test_make_batch_indices_with_grad_accum(tmp_path: Path) -> None:
    seen: list[int] = []

    def make_batch(index: int, model: torch.nn.Module):
        seen.append(index)
        return _make_batch(index, model)

    cfg = _config(tmp_path, max_steps=3, grad_accum=2, checkpoint_every=0)
    train(_mlp(0), make_batch, _mse_loss(), cfg)
    assert seen == [0, 1, 2, 3, 4, 5]


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((step, metrics))


def test_tracker_and_lr_schedule(tmp_path: Path) -> None:
    tracker = _Recorder()
    result = train(
        _mlp(0), _make_batch, _mse_loss(), _config(tmp_path, max_steps=5, checkpoint_every=0), tracker
    )
    assert [s for s, _ in tracker.calls] == [2, 4, 5]  # every log_every steps, plus the last
    assert {"loss", "mse", "lr", "grad_norm"} <= set(tracker.calls[-1][1])
    lrs = [h["lr"] for h in result.history]
    assert lrs == pytest.approx([0.015, 0.03, 0.03, 0.02, 0.01])  # warmup 2, then linear decay


def test_lr_factor_shapes() -> None:
    cfg = TrainConfig(max_steps=10, warmup_steps=0)
    assert _lr_factor(0, cfg) == 1.0 and _lr_factor(9, cfg) == pytest.approx(0.1)
    const = replace(cfg, warmup_steps=4, lr_schedule="constant")
    assert [_lr_factor(s, const) for s in (0, 3, 9)] == [0.25, 1.0, 1.0]


def test_non_finite_loss_stops_the_run(tmp_path: Path) -> None:
    def bad_loss(model, batch):
        return model(batch[0]).sum() * float("nan"), {}

    with pytest.raises(FloatingPointError, match="step 1"):
        train(_mlp(0), _make_batch, bad_loss, _config(tmp_path, checkpoint_every=0))


def _tiny_qwen(seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen3ForCausalLM(config)


def test_resume_exact_with_tied_weight_transformer(tmp_path: Path) -> None:
    def make_batch(index: int, model: torch.nn.Module) -> torch.Tensor:
        return torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(index))

    def loss_fn(model: torch.nn.Module, ids: torch.Tensor):
        out = model(input_ids=ids, labels=ids)
        return out.loss, {}

    seed_everything(0)
    ref_model = _tiny_qwen(0)
    cfg = _config(tmp_path / "a", max_steps=4, checkpoint_every=2, lr=1e-2)
    train(ref_model, make_batch, loss_fn, cfg)
    half = _tiny_qwen(0)
    train(
        half, make_batch, loss_fn, replace(_config(tmp_path / "b", max_steps=4, checkpoint_every=2, lr=1e-2))
    )
    # Drop the final checkpoint so the next run resumes from step 2, then continue into a fresh model.
    import shutil

    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-000004")
    resumed = _tiny_qwen(5)
    result = train(resumed, make_batch, loss_fn, replace(cfg, output_dir=str(tmp_path / "b")))
    assert result.resumed_from == 2
    assert resumed.lm_head.weight.data_ptr() == resumed.model.embed_tokens.weight.data_ptr()  # still tied
    _assert_same_weights(resumed, ref_model)


def test_move_to_moves_every_tensor_of_a_nested_batch_and_nothing_else() -> None:
    @dataclasses.dataclass(frozen=True)
    class Inner:
        ids: torch.Tensor
        tokens: list[int]

    @dataclasses.dataclass(frozen=True)
    class Outer:
        inner: Inner
        by_name: dict[str, torch.Tensor]
        parts: list[Inner]
        scale: float

    batch = Outer(Inner(torch.ones(2), [1, 2]), {"a": torch.zeros(3)}, [Inner(torch.ones(1), [])], 0.5)
    moved = move_to(batch, torch.device("meta"))  # a device every CPU build has
    assert moved.inner.ids.is_meta and moved.by_name["a"].is_meta and moved.parts[0].ids.is_meta
    assert moved.inner.tokens == [1, 2] and moved.scale == 0.5
    assert not batch.inner.ids.is_meta  # the original is left as it was


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", torch.bfloat16), ("no", torch.float32)])
def test_mixed_precision_applies_to_every_forward_the_loss_runs(
    tmp_path: Path, precision: str, dtype: torch.dtype
) -> None:
    """The loss calls the model's parts directly (as ours call ``base_model`` and the LM head), not
    ``model.forward``: bf16 autocast must still cover them, and the master weights stay fp32."""
    seen: list[torch.dtype] = []

    def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
        x, y = batch
        hidden = model[0](x)  # a submodule, bypassing model.forward
        seen.append(hidden.dtype)
        out = model[4](model[3](model[1](hidden)))
        return torch.nn.functional.mse_loss(out.float(), y), {}

    model = _mlp(0)
    train(
        model,
        _make_batch,
        loss_fn,
        _config(tmp_path, max_steps=2, checkpoint_every=0, mixed_precision=precision),
    )
    assert seen == [dtype, dtype]
    assert all(p.dtype == torch.float32 for p in model.parameters())
