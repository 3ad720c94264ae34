"""A tiny served world for the operations tests: catalogue, tokenizer, random models, own MLflow store."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import torch

from diffusion_gr2.core.model.factory import save_model
from diffusion_gr2.core.serving.serving import ServingConfig
from diffusion_gr2.core.text.prompt import ItemLookup, PromptConfig, build_messages, render_answer
from diffusion_gr2.core.text.tokenizer import build_tokenizer
from tests.conftest import empty_mlflow_store
from tests.core.model.tiny import tiny_model_for
from tests.core.text.synthetic import make_candidates, make_items, make_sids, sid_tokens

DECODING = {"max_new_tokens": 48, "batch_size": 8, "device": "cpu"}


@dataclass(frozen=True)
class World:
    """Item catalogue, test requests (internal ids) and saved tiny models (`rl`, `ar_rl`)."""

    items: pd.DataFrame
    sids: pd.DataFrame
    candidates: pd.DataFrame
    models: dict[str, Path]

    def config(self, system: str = "rl", **decoding) -> ServingConfig:
        tau = None if system == "ar_rl" else 0.9
        return ServingConfig(system=system, tau=tau, decoding={**DECODING, **decoding})

    def raw(self, item_ids) -> list[str]:
        raw_of = dict(zip(self.items["item_id"], self.items["raw_item_id"], strict=True))
        return [str(raw_of[int(i)]) for i in item_ids]


def build_world(root: Path, n_users: int = 6) -> World:
    items, sids = make_items(40, seed=0), make_sids(40, seed=1)
    cands = make_candidates(items, n_users, seed=2, history_len=5).assign(split="test")
    config, texts = PromptConfig(history_in_prompt=10, title_words=6), []
    lookup = ItemLookup.from_frames(items, sids, config)
    for row in cands.itertuples(index=False):
        texts += [
            m["content"] for m in build_messages(list(row.history), list(row.candidates), lookup, config)
        ]
        texts.append(render_answer("drama first", lookup.sids(row.candidates)))
    tokenizer = build_tokenizer(texts, sid_tokens(), vocab_size=400)
    models = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        models["rl"] = save_model(tiny_model_for(tokenizer, block_size=4), tokenizer, root / "rl")
        models["ar_rl"] = save_model(tiny_model_for(tokenizer), tokenizer, root / "ar_rl")
    return World(items, sids, cands, models)


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return build_world(tmp_path_factory.mktemp("world"))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[str]:
    """A fresh sqlite MLflow store (tracking and registry) for one test."""
    uri = empty_mlflow_store(tmp_path / "mlflow.db")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        while mlflow.active_run() is not None:
            mlflow.end_run()
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
        mlflow.set_experiment("ops-test")
        yield uri
        while mlflow.active_run() is not None:
            mlflow.end_run()


def rerank_folder(
    folder: Path, files: dict[str, object], model_uri: str, serving: dict, chunk_size: int = 4
) -> tuple[pd.DataFrame, dict]:
    """The batch re-rank pipeline's two nodes over `files` (name -> JSON content, written into
    `folder/requests`), answers saved in `folder/reranked`: (all answers, the report)."""
    import json

    from diffusion_gr2.datasets import AnswerChunksDataset, RequestFilesDataset
    from diffusion_gr2.pipelines.rerank.nodes import answer_requests, summarize_answers

    (folder / "requests").mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (folder / "requests" / f"{name}.json").write_text(json.dumps(content))
    params = {"model_uri": model_uri, "chunk_size": chunk_size}
    output = AnswerChunksDataset(str(folder / "reranked"))
    output.save(answer_requests(RequestFilesDataset(str(folder / "requests")).load(), params, serving))
    report = summarize_answers(output.load(), params)
    return pd.read_parquet(folder / "reranked"), report


@contextmanager
def champion_in(world: World, uri: str, experiment: str) -> Iterator[str]:
    """The store at `uri` made current (tracking, registry, `MLFLOW_TRACKING_URI`) with the world's
    `rl` model registered and promoted to champion of `diffusion-gr2`; its version."""
    from diffusion_gr2.core.registry import registry

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
        mlflow.set_experiment(experiment)
        ref = registry.register_reranker(
            registry.DIFFUSION_MODEL, world.models["rl"], world.items, world.sids, world.config()
        )
        registry.promote(registry.DIFFUSION_MODEL, ref.version, "first version")
        yield ref.version
