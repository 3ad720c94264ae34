"""The one training loop: SFT, CFT, OPD and RL each contribute a loss function, not a loop
(docs/architecture.md#code-conventions).

Runs on ``accelerate``: one process (CPU or GPU) or several (``accelerate launch``: DDP, or FSDP
when its config says so), with AdamW and a linear warmup, a tqdm bar, periodic atomic checkpoints and
exact resume (docs/architecture.md#training-stages). The loss is what accelerate prepares (`LossModule`):
DDP's gradient buckets, FSDP's sharding and mixed-precision autocast all wrap the forward every loss runs,
whatever model methods it calls. Gradient accumulation is accelerate's. Exactness rests on two rules:
``make_batch(index, model)`` is a pure function of the index (and of state restored from the
checkpoint: weights and RNG), and every piece of state the next step reads — weights, optimizer,
scheduler, RNG — is saved at the checkpoint (``Accelerator.save_state``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import random
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, InitProcessGroupKwargs, gather_object
from torch.distributed.fsdp import FSDPModule
from tqdm.auto import tqdm

from diffusion_gr2.core.train.checkpoint import (
    LoopState,
    checkpoint_dirs,
    prune_checkpoints,
    remove_stale_temp_dirs,
    restore_latest,
    save_checkpoint,
)
from diffusion_gr2.core.train.fsdp import full_weights, held_units

logger = logging.getLogger(__name__)

__all__ = ["LossFn", "MakeBatch", "Tracker", "TrainConfig", "TrainResult", "seed_everything", "train"]

MakeBatch = Callable[[int, torch.nn.Module], Any]
LossFn = Callable[[torch.nn.Module, Any], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and bookkeeping of one training run."""

    output_dir: str = "data/06_models/train"  # checkpoints go to <output_dir>/checkpoints/
    lr: float = 1e-4  # peak AdamW learning rate
    weight_decay: float = 0.0  # decoupled decay; never applied to biases and norm weights
    max_steps: int = 100  # optimizer steps
    warmup_steps: int = 0  # linear warmup from lr/warmup to lr
    lr_schedule: Literal["linear", "constant"] = "linear"  # after warmup: decay to ~0, or hold (OPD/RL)
    grad_accum: int = 1  # micro-batches per optimizer step
    max_grad_norm: float = 1.0  # clip threshold; <= 0 disables clipping
    seed: int = 0  # process p is seeded with seed + p
    checkpoint_every: int = 50  # steps between checkpoints; <= 0 disables checkpoints
    keep_checkpoints: int = 2  # newest checkpoints kept on disk
    log_every: int = 10  # steps between tracker/log lines (the last step is always logged)
    resume: bool = True  # continue from the latest complete checkpoint in output_dir
    cpu: bool = False  # force CPU even where a GPU is present
    mixed_precision: Literal["no", "fp16", "bf16"] = "no"  # accelerate's autocast mode
    progress: bool = True  # show the tqdm bar (main process only)


class Tracker(Protocol):
    """Anything that records metrics (an MLflow adapter lives in ``core/runs/mlflow_utils.py``)."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...


@dataclass(frozen=True)
class TrainResult:
    """Outcome of :func:`train`; ``history`` covers every step, including those before a resume."""

    steps: int
    final_metrics: dict[str, float]
    history: list[dict[str, float]] = field(default_factory=list)
    resumed_from: int | None = None  # step of the checkpoint the run continued from
    seconds: float = 0.0  # time spent in training steps, those before a resume included
    processes: int = 1  # how many processes trained (each on its own micro-batches)
    peak_memory_mb: float = 0.0  # this process's peak resident memory (CPU) or allocated memory (GPU)
    # Under FSDP the model's own parameters end as shards: the full weights, gathered on every
    # process (None whenever the model itself holds them).
    full_state_dict: dict[str, torch.Tensor] | None = None


COLLECTIVE_TIMEOUT_ENV = "DIFFUSION_GR2_COLLECTIVE_TIMEOUT_S"


def collective_timeout() -> timedelta:
    """How long a collective waits for a silent process before the launch fails (default 30 min).

    A dead process is seen at once (its sockets close, and the launcher stops the others); this bounds
    the wait for one that hangs. Set ``DIFFUSION_GR2_COLLECTIVE_TIMEOUT_S`` to change it.
    """
    return timedelta(seconds=float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, "1800")))


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _lr_factor(step: int, config: TrainConfig) -> float:
    """Multiplier of the peak lr for 0-based optimizer step ``step`` (never 0 inside the run)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return 1.0
    return max(config.max_steps - step, 0) / max(config.max_steps - config.warmup_steps, 1)


def _build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW; 1-D parameters (biases, norm gains) are not decayed, as is standard for transformers."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=config.lr)


def _check_world(accelerator: Accelerator) -> None:
    """Refuse the torchrun trap: several unsynchronised processes that all think they are alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != world:
        raise RuntimeError(
            f"accelerate sees {accelerator.num_processes} process(es) but WORLD_SIZE={world}; "
            "on CPU set TrainConfig.cpu=True or ACCELERATE_USE_CPU=1"
        )


def _mean_metrics(dicts: list[dict[str, float]]) -> dict[str, float]:
    """Key-wise mean of metric dicts (a key missing from some dicts is averaged over those that have it)."""
    keys = sorted({k for d in dicts for k in d})
    return {k: float(np.mean([d[k] for d in dicts if k in d])) for k in keys}


class LossModule(torch.nn.Module):
    """The loss as a module: what accelerate prepares, so DDP, FSDP and autocast wrap its forward.

    ``loss_fn`` may call any method of the model (``base_model``, the LM head, a replay): all of it runs
    inside this forward, so DDP sees every parameter's gradient and bf16 autocast applies to all of it.
    A loss without a graph (an RL micro-batch with no kept rollout) becomes a graph-connected zero, so
    every process still takes part in the gradient all-reduce.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self._loss_fn = loss_fn

    def forward(self, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        loss, metrics = self._loss_fn(self.model, batch)
        if torch.is_grad_enabled() and not loss.requires_grad:
            loss = loss + sum(p.sum() for p in self.parameters() if p.requires_grad) * 0.0
        return loss, metrics


@dataclass
class _Run:
    """Everything one optimizer step touches."""

    accelerator: Accelerator
    model: torch.nn.Module  # unwrapped: what make_batch and loss_fn see
    wrapped: torch.nn.Module  # the prepared LossModule (DDP/FSDP-wrapped, autocast forward)
    optimizer: Any
    scheduler: Any
    config: TrainConfig
    # FSDP units whose full weights are held through each step (stages that decode; else empty)
    held: list[FSDPModule] = field(default_factory=list)

    def batch_index(self, step: int, micro: int) -> int:
        """Global micro-batch index (0-based), distinct over steps, micro-batches and processes."""
        acc = self.accelerator
        return ((step * self.config.grad_accum) + micro) * acc.num_processes + acc.process_index

    @property
    def sharded(self) -> bool:
        return self.accelerator.distributed_type == DistributedType.FSDP


def move_to(obj: Any, device: torch.device) -> Any:
    """`obj` with every tensor on `device`, looking inside dataclasses, named tuples, dicts and sequences.

    Batches are built on the CPU (collation, seeded noise); the loop moves them to the model's device.
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: move_to(getattr(obj, f.name), device) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **fields)
    if isinstance(obj, dict):
        return {k: move_to(v, device) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(move_to(v, device) for v in obj))
    if isinstance(obj, list | tuple) and any(_holds_tensors(v) for v in obj):
        return type(obj)(move_to(v, device) for v in obj)
    return obj  # anything else (token lists, numbers, grammars) as it is


def _holds_tensors(obj: Any) -> bool:
    """Whether `move_to` may have a tensor to move inside `obj` (plain numbers never do)."""
    return isinstance(obj, torch.Tensor | dict | list | tuple) or dataclasses.is_dataclass(obj)


def _train_step(run: _Run, step: int, make_batch: MakeBatch) -> dict[str, float]:
    """One optimizer step (0-based ``step``) over ``grad_accum`` micro-batches; returns its metrics."""
    config, acc = run.config, run.accelerator
    micro_metrics: list[dict[str, float]] = []
    with full_weights(run.held):  # under FSDP, rollout stages hold the full weights through the step
        for micro in range(config.grad_accum):
            # accumulate: no gradient all-reduce until the last micro-batch; backward divides by grad_accum
            with acc.accumulate(run.wrapped):
                with acc.autocast():  # rollouts are sampled at the precision the loss scores them at
                    batch = move_to(make_batch(run.batch_index(step, micro), run.model), acc.device)
                loss, metrics = run.wrapped(batch)
                if not torch.isfinite(loss.detach()).all():
                    raise FloatingPointError(f"non-finite loss {loss.item()} at step {step + 1}")
                acc.backward(loss)
            micro_metrics.append({**{k: float(v) for k, v in metrics.items()}, "loss": float(loss.detach())})
    grad_norm = math.nan
    if config.max_grad_norm > 0:
        grad_norm = float(acc.clip_grad_norm_(run.wrapped.parameters(), config.max_grad_norm))
    lr = run.scheduler.get_last_lr()[0]
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    local = _mean_metrics(micro_metrics)
    merged = _mean_metrics(gather_object([local])) if acc.num_processes > 1 else local
    return {**merged, "lr": lr, "grad_norm": grad_norm, "step": float(step + 1)}


def _checkpoint_due(step: int, config: TrainConfig) -> bool:
    """Every ``checkpoint_every`` steps and at the end (so a finished run resumes as a no-op)."""
    if config.checkpoint_every <= 0:
        return False
    return step % config.checkpoint_every == 0 or step == config.max_steps


def _checkpoint(run: _Run, root: Path, state: LoopState) -> None:
    """Every process writes its part of the state; the main process publishes it and prunes."""
    acc = run.accelerator
    path = save_checkpoint(root / f"step-{state.step:06d}", acc, state)
    if acc.is_main_process:
        prune_checkpoints(root, run.config.keep_checkpoints)
        logger.info("checkpoint %s", path)
    acc.wait_for_everyone()


def _restore(run: _Run, root: Path) -> tuple[LoopState, int | None]:
    """Resume from the newest usable checkpoint (damaged ones are skipped with a warning), or start
    fresh (discarding stale checkpoints)."""
    acc, config = run.accelerator, run.config
    if acc.is_main_process:
        remove_stale_temp_dirs(root)  # half-written folders of a killed run
    acc.wait_for_everyone()
    restored = restore_latest(root, acc) if config.resume else None
    if restored is None:
        if not config.resume and checkpoint_dirs(root) and acc.is_main_process:
            # Stale checkpoints of an earlier run would outrank the new ones at the next resume.
            logger.warning("resume=False: discarding existing checkpoints in %s", root)
            prune_checkpoints(root, keep=0)
        acc.wait_for_everyone()
        return LoopState(), None
    latest, state = restored
    logger.info("resumed from %s (step %d)", latest, state.step)
    return state, state.step


def _log(run: _Run, metrics: dict[str, float], tracker: Tracker | None) -> None:
    """Send one step's metrics to the log and the tracker (main process only)."""
    step = int(metrics["step"])
    last = step == run.config.max_steps
    if not run.accelerator.is_main_process or not (last or step % max(run.config.log_every, 1) == 0):
        return
    logger.info("step %d: %s", step, ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k != "step"))
    if tracker is not None:
        tracker.log_metrics({k: v for k, v in metrics.items() if k != "step"}, step=step)


def _make_accelerator(config: TrainConfig) -> Accelerator:
    """An Accelerator for this stage; earlier stages' settings (precision, accumulation) do not stick."""
    # step_scheduler_with_optimizer=False: otherwise accelerate steps the schedule num_processes
    # times per optimizer step (it assumes a dataloader that shrinks with the process count).
    kwargs = {
        "cpu": config.cpu,
        "mixed_precision": config.mixed_precision,
        "gradient_accumulation_steps": config.grad_accum,
        "step_scheduler_with_optimizer": False,
        "kwargs_handlers": [InitProcessGroupKwargs(timeout=collective_timeout())],
    }
    try:
        return Accelerator(**kwargs)
    except ValueError:
        # accelerate's state is a process-wide singleton that refuses new settings (e.g. a bf16 stage
        # after an fp32 one in one `kedro run`). The process group lives in the partial state, which
        # is kept when there is one; the stage's settings are rebuilt on top of it.
        AcceleratorState._reset_state(reset_partial_state=int(os.environ.get("WORLD_SIZE", "1")) <= 1)
        return Accelerator(**kwargs)


def _prepare(model: torch.nn.Module, loss_fn: LossFn, config: TrainConfig, decodes: bool) -> _Run:
    """Accelerator, AdamW, LR schedule, all prepared; the scheduler steps exactly once per step.

    ``decodes``: ``make_batch`` calls the model (rollouts), so under FSDP the step holds the full
    weights (``core/train/fsdp.py``)."""
    acc = _make_accelerator(config)
    _check_world(acc)
    seed_everything(config.seed + acc.process_index)
    module = LossModule(model, loss_fn)
    # Under FSDP2 accelerate shards the parameters in place and moves the optimizer onto the shards,
    # which it does only when the model and its optimizer are prepared in one call.
    optimizer = _build_optimizer(module, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, config))
    wrapped, optimizer, scheduler = acc.prepare(module, optimizer, scheduler)
    held = held_units(wrapped) if decodes else []  # [] unless sharded
    return _Run(acc, acc.unwrap_model(wrapped).model, wrapped, optimizer, scheduler, config, held)


def peak_memory_mb(device: torch.device | None = None) -> float:
    """This process's peak memory so far: allocated GPU memory on CUDA, resident set size on the CPU."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


@contextlib.contextmanager
def _released(run: _Run) -> Iterator[None]:
    """Hand the accelerator's references back when the stage ends, so the next stage starts clean."""
    try:
        yield
    finally:
        run.accelerator.free_memory()


def train(
    model: torch.nn.Module,
    make_batch: MakeBatch,
    loss_fn: LossFn,
    config: TrainConfig,
    tracker: Tracker | None = None,
    decodes: bool = False,
) -> TrainResult:
    """Train ``model`` in place for ``config.max_steps`` optimizer steps.

    ``make_batch(index, model)`` builds micro-batch ``index`` (0-based, unique over steps,
    micro-batches and processes; equal to the 0-based step for one process without accumulation). It
    must be a pure function of the index and the seed — it may use the model (OPD/RL rollouts) and the
    global RNG, both restored exactly on resume. ``loss_fn(model, batch) -> (loss, metrics)`` gets the
    unwrapped model and runs inside the prepared module's forward. A run killed mid-way and restarted
    with ``resume=True`` ends with exactly the weights of an uninterrupted run. ``decodes``: say so
    when ``make_batch`` decodes with the model (OPD/RL rollouts), which FSDP then allows.
    """
    run = _prepare(model, loss_fn, config, decodes)
    with _released(run):
        return _train(run, make_batch, config, tracker)


def _train(run: _Run, make_batch: MakeBatch, config: TrainConfig, tracker: Tracker | None) -> TrainResult:
    acc = run.accelerator
    root = Path(config.output_dir) / "checkpoints"
    state, resumed_from = _restore(run, root)
    run.wrapped.train()
    bar = tqdm(
        total=config.max_steps,
        initial=state.step,
        desc="train",
        disable=not (config.progress and acc.is_local_main_process),
    )
    for step in range(state.step, config.max_steps):
        started = time.perf_counter()
        metrics = _train_step(run, step, make_batch)
        state.seconds += time.perf_counter() - started  # saved with the checkpoint: survives a resume
        state.step = step + 1
        state.history.append(metrics)
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.4f}")
        _log(run, metrics, tracker)
        if _checkpoint_due(state.step, config):
            _checkpoint(run, root, state)
    bar.close()
    full = None
    if run.sharded:  # an all-gather: every process ends with the full weights, on the CPU
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        gathered = get_model_state_dict(run.wrapped, options=StateDictOptions(full_state_dict=True))
        full = {k.removeprefix("model."): v.detach().cpu() for k, v in gathered.items()}
    final = state.history[-1] if state.history else {}
    return TrainResult(
        state.step,
        dict(final),
        list(state.history),
        resumed_from,
        state.seconds,
        acc.num_processes,
        peak_memory_mb(acc.device),
        full,
    )
