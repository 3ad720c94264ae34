"""Warm start of a retrain (`retrain.warm_start`, docs/operations.md#retraining): fine-tune the champion, not
a new model.

`plan_warm_start` copies the champion of `diffusion-gr2` and the teacher version it was trained with
(its `teacher_version` tag) out of the registry and writes the plan the other nodes read. With a plan, four nodes of
the default DAG take the champion's part instead of building their own, so the new models start
from its weights with the vocabulary those weights were trained on:

* `fit_item_sids`: the champion's SIDs for the items it knew, new items placed beside their nearest
  known one (`core.sid.carry_over`); no RQ-VAE is trained.
* `train_tokenizer`: the champion's tokenizer (a new BPE would renumber every embedding row).
* `build_ar_model`: the champion teacher's weights instead of a random (or pretrained) model.
* `convert_teacher`: the champion's diffusion weights instead of a conversion of the new teacher
  (CFT, OPD and RL continue from them; OPD's teacher is the new, fine-tuned `ar_rl`).

Every training node also takes the plan and trains under `warm_start.budgets` (the copy stage is
skipped: the champion already copies SIDs). Without a plan (disabled, or no champion yet) every node
is the default DAG's own: a cold start is the full recipe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
from mlflow import MlflowClient

from diffusion_gr2.core.rank.rerank import SERVED_DIFFUSION
from diffusion_gr2.core.registry import registry
from diffusion_gr2.core.runs.mlflow_utils import as_metrics_history

logger = logging.getLogger(__name__)

# Nodes that read a champion folder: (system, artifact) of what they read. The lineage hook names it
# as an input, under the dataset name its producer wrote it as, so the walk crosses into the run
# that trained the champion.
CHAMPION_INPUTS = {
    "fit_item_sids": (SERVED_DIFFUSION, "catalogue"),
    "train_tokenizer": ("ar_rl", "model"),
    "build_ar_model": ("ar_rl", "model"),
    "convert_teacher": (SERVED_DIFFUSION, "model"),
}


def is_warm(plan: dict[str, Any] | None) -> bool:
    return bool(plan and plan.get("warm"))


def plan_warm_start(params: dict[str, Any], ingest_report: dict[str, Any]) -> dict[str, Any]:
    """The champion's folders and the warm budgets, or why this retrain starts cold.

    Runs after the ingest (its report is an input only for the order): the retrain lock is held.
    """
    warm = params["warm_start"]
    if not warm["enabled"]:
        return {"warm": False, "reason": "retrain.warm_start.enabled is false"}
    client = MlflowClient()
    champion = registry.alias_version(registry.DIFFUSION_MODEL, registry.CHAMPION, client)
    if champion is None:
        reason = f"no champion of {registry.DIFFUSION_MODEL} in the registry: cold start (the full recipe)"
        logger.warning("warm start: %s", reason)
        return {"warm": False, "reason": reason}
    # The teacher trained with the champion (same tokenizer and SIDs), not whatever the teacher's own
    # alias points at: the two aliases can part (a rollback moves one model's alias).
    teacher = client.get_model_version(registry.DIFFUSION_MODEL, champion.version).tags.get("teacher_version")
    if teacher is None:
        raise ValueError(
            f"{registry.DIFFUSION_MODEL} v{champion.version} has no teacher_version tag: the warm start "
            "cannot tell which teacher shares its vocabulary; retrain cold (retrain.warm_start.enabled: false)"
        )
    teacher_ref = client.get_model_version(registry.TEACHER_MODEL, teacher)
    refs = {
        SERVED_DIFFUSION: champion,
        "ar_rl": registry.VersionRef(registry.TEACHER_MODEL, teacher, teacher_ref.run_id),
    }
    models = {}
    for system, ref in refs.items():
        files = registry.download_version(ref, Path(warm["dir"]) / system)
        models[system] = {
            "name": ref.name,
            "version": ref.version,
            "run_id": ref.run_id,
            **{artifact: str(path) for artifact, path in files.items()},
        }
    if mlflow.active_run() is not None:
        mlflow.set_tags(
            {"warm_start": "true", **{f"warm_start.{s}_version": m["version"] for s, m in models.items()}}
        )
    logger.info("warm start from %s", ", ".join(f"{m['name']} v{m['version']}" for m in models.values()))
    return {"warm": True, "models": models, "budgets": dict(warm["budgets"])}


def champion_files(node_name: str, plan: dict[str, Any] | None) -> dict[str, Path]:
    """The champion folder `node_name` reads under `plan`, keyed as its producer named it (lineage)."""
    if not is_warm(plan) or node_name not in CHAMPION_INPUTS:
        return {}
    system, artifact = CHAMPION_INPUTS[node_name]
    name = f"model_{system}" if artifact == "model" else f"champion_{artifact}"
    return {name: _folder(plan, node_name)}


def _folder(plan: dict[str, Any], node_name: str) -> Path:
    system, artifact = CHAMPION_INPUTS[node_name]
    return Path(plan["models"][system][artifact])


def _plan_node(
    original: Callable[..., Any], cold: Callable[..., Any], warm: Callable[..., Any]
) -> Callable[..., Any]:
    """A node taking the plan as its last input: `warm(plan, *args)` when it is warm, else `cold(*args)`.

    It keeps `original`'s name and doc but not `functools.wraps`: Kedro binds a node's inputs to the
    signature `wraps` would report (the original's, without the plan).
    """

    def node(*args: Any) -> Any:
        *args, plan = args
        return warm(plan, *args) if is_warm(plan) else cold(*args)

    node.__name__ = node.__qualname__ = original.__name__
    node.__doc__ = original.__doc__
    return node


def warm_sids(fit: Callable[..., Any]) -> Callable[..., Any]:
    """`fit_item_sids(item_embeddings, embedding_info, params, items, plan)`: carried over when warm."""
    from diffusion_gr2.core.sid.carry_over import carry_over_sids
    from diffusion_gr2.core.sid.rqvae import sids_frame

    def carry(
        plan: dict[str, Any], embeddings: pd.DataFrame, info: dict[str, Any], _: Any, items: pd.DataFrame
    ):
        catalogue = _folder(plan, "fit_item_sids")
        ordered = embeddings.sort_values("item_id")
        carried = carry_over_sids(
            items,
            np.stack(ordered["vector"].to_numpy()),
            pd.read_parquet(catalogue / "items.parquet"),
            pd.read_parquet(catalogue / "sids.parquet"),
        )
        report = {
            **carried.report,
            "embedding_model": info["embedding_model"],
            "embedding_sha256": info["embedding_sha256"],
            "champion_version": plan["models"][SERVED_DIFFUSION]["version"],
        }
        logger.info("SIDs carried over from the champion: %s", carried.report)
        return sids_frame(carried.codes), report, as_metrics_history(report)

    return _plan_node(fit, lambda embeddings, info, params, items: fit(embeddings, info, params), carry)


def warm_tokenizer(train: Callable[..., Any]) -> Callable[..., Any]:
    """`train_tokenizer(..., plan)`: the champion's tokenizer when warm; it must spell every SID."""
    from transformers import PreTrainedTokenizerFast

    from diffusion_gr2.core.text.tokenizer import sid_tokens_from_sids

    def reuse(
        plan: dict[str, Any], traces: pd.DataFrame, sids: pd.DataFrame, *_: Any
    ) -> PreTrainedTokenizerFast:
        folder = _folder(plan, "train_tokenizer")
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
        vocab = tokenizer.get_vocab()
        diffusion = Path(plan["models"][SERVED_DIFFUSION]["model"])
        if (
            PreTrainedTokenizerFast.from_pretrained(str(diffusion), local_files_only=True).get_vocab()
            != vocab
        ):
            raise ValueError(f"the champion's tokenizers differ ({folder} against {diffusion})")
        if missing := [t for t in sid_tokens_from_sids(sids["sid"]) if t not in vocab]:
            raise ValueError(f"the champion's tokenizer ({folder}) has no SID token {missing[:5]}")
        return tokenizer

    return _plan_node(train, train, reuse)


def warm_teacher(build: Callable[..., Any]) -> Callable[..., Any]:
    """`build_ar_model(tokenizer, params, plan)`: the champion teacher's weights when warm."""
    from diffusion_gr2.core.model.factory import load_model

    def reuse(plan: dict[str, Any], tokenizer: Any, _: Any) -> Any:
        model = load_model(_folder(plan, "build_ar_model"))
        rows = model.get_input_embeddings().num_embeddings
        if rows < len(tokenizer):
            raise ValueError(f"the champion teacher has {rows} embedding rows for {len(tokenizer)} tokens")
        return model

    return _plan_node(build, build, reuse)


def warm_conversion(convert: Callable[..., Any]) -> Callable[..., Any]:
    """`convert_teacher(model_ar_rl, tokenizer, params, plan)`: the champion's diffusion weights when warm."""
    from diffusion_gr2.core.model.factory import load_model
    from diffusion_gr2.core.train.stages import policy_block_size

    def reuse(plan: dict[str, Any], _: Any, tokenizer: Any, params: dict[str, Any]) -> Any:
        folder = _folder(plan, "convert_teacher")
        model = load_model(folder)
        block, mask = policy_block_size(model), getattr(model.config, "mask_token_id", None)
        if block != params["block_size"] or mask != tokenizer.mask_token_id:
            raise ValueError(
                f"the champion ({folder}) has block size {block} and mask id {mask}; this run asks for "
                f"{params['block_size']} and {tokenizer.mask_token_id}: retrain cold to change them"
            )
        return model

    return _plan_node(convert, convert, reuse)


def warm_budget(train: Callable[..., Any], stage: str, params_at: int) -> Callable[..., Any]:
    """A training node whose `train` settings take `budgets[stage]` when warm (its args, then the plan)."""

    def shorter(plan: dict[str, Any], *args: Any) -> Any:
        budget = plan["budgets"].get(stage) or {}
        if budget and mlflow.active_run() is not None:  # the run's `<stage>.train.*` params are the cold ones
            mlflow.log_params({f"{stage}.warm_start.train.{k}": v for k, v in budget.items()})
        args = list(args)
        args[params_at] = {**args[params_at], "train": {**args[params_at]["train"], **budget}}
        return train(*args)

    return _plan_node(train, train, shorter)
