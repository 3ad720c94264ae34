"""End-to-end retrains at smoke sizes: a cold one (no champion yet), then a warm one from its champion;
the retrain's operating point is inference's."""

from __future__ import annotations

import copy
import itertools
import json
import types
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
import yaml
from mlflow import MlflowClient
from transformers import PreTrainedTokenizerFast

from diffusion_gr2.core.bench import benchmark
from diffusion_gr2.core.bench.benchmark import time_candidates
from diffusion_gr2.core.data.recbole import embedded_ml100k_folder
from diffusion_gr2.core.lineage.lineage_report import lineage_lines
from diffusion_gr2.core.rank import rerank
from diffusion_gr2.core.rank.rerank import SERVED_DIFFUSION
from diffusion_gr2.core.registry import registry
from diffusion_gr2.pipelines.inference.nodes import make_rerank_node
from diffusion_gr2.pipelines.retrain.nodes import choose_operating_point
from tests.conftest import isolated_project, run_kedro
from tests.core.model.tiny import tiny_model_for
from tests.core.rank.world import make_world

HEADER = "user_id:token\titem_id:token\trating:float\ttimestamp:float"


def fresh_rows(n: int, offset: int) -> str:
    """`n` ratings no user has given yet, later than every MovieLens-100k timestamp."""
    inter = pd.read_csv(embedded_ml100k_folder() / "ml-100k.inter", sep="\t")
    inter.columns = ["user", "item", "rating", "time"]
    seen = set(zip(inter["user"], inter["item"], strict=True))
    popular = inter["item"].value_counts().index[:50]
    rows, start = [], int(inter["time"].max()) + 1000
    for user in sorted(inter["user"].unique())[offset:]:
        item = next(i for i in popular if (user, i) not in seen)
        rows.append(f"{user}\t{item}\t4\t{start + len(rows)}")
        if len(rows) == n:
            break
    return "\n".join([HEADER, *rows]) + "\n"


def sid_by_raw_id(items: pd.DataFrame, sids: pd.DataFrame) -> dict[str, str]:
    merged = items.merge(sids, on="item_id", validate="one_to_one")
    return dict(zip(merged["raw_item_id"].astype(str), merged["sid"], strict=True))


def read(root: Path, name: str) -> dict:
    return json.loads((root / "data/08_reporting" / name).read_text())


@pytest.mark.slow
def test_a_cold_retrain_then_a_warm_one_from_its_champion(tmp_path: Path) -> None:
    with isolated_project(tmp_path / "project") as root:
        # smoke's policy holds the floors at 0 already; its gate margin (0.02) is one models that learn
        # nothing at smoke sizes may miss, and this test is about the mechanism
        conf = root / "conf/smoke/parameters_policy.yml"
        policy = yaml.safe_load(conf.read_text())
        policy["policy"]["gate_margin"] = 1.0
        conf.write_text(yaml.safe_dump(policy))
        params = yaml.safe_load((root / "conf/smoke/parameters_retrain.yml").read_text())
        incoming = root / "data/01_raw/incoming"
        incoming.mkdir(parents=True)

        (incoming / "ml-100k.week1.inter").write_text(fresh_rows(20, offset=0))
        run_kedro(root, ["retrain"])
        plan = read(root, "retrain/warm_start.json")
        assert not plan["warm"] and "no champion" in plan["reason"]
        assert read(root, "training/ar_mid.json")["steps"] > 0  # cold: the full recipe, copy stage too
        first = read(root, "retrain/gate.json")
        assert first["decision"] == "promote" and first["champion_version"] is None
        first_sids = pd.read_parquet(root / "data/04_feature/sids.parquet")
        first_items = pd.read_parquet(root / "data/03_primary/items.parquet")

        (incoming / "ml-100k.week2.inter").write_text(fresh_rows(20, offset=200))
        run_kedro(root, ["retrain"])
        plan = read(root, "retrain/warm_start.json")
        assert plan["warm"] and plan["models"][SERVED_DIFFUSION]["version"] == first["challenger_version"]
        budgets = params["retrain"]["warm_start"]["budgets"]
        assert read(root, "training/ar_mid.json") == {"steps": 0, "skipped": True}
        assert read(root, "training/ar_sft.json")["steps"] == budgets["teacher_sft"]["max_steps"]
        assert read(root, "training/cft.json")["steps"] == budgets["cft"]["max_steps"]
        # the champion's vocabulary: the same tokenizer, every known item keeps its SID
        champion_tokenizer = PreTrainedTokenizerFast.from_pretrained(plan["models"]["ar_rl"]["model"])
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(root / "data/06_models/tokenizer"))
        assert tokenizer.get_vocab() == champion_tokenizer.get_vocab()
        sids = pd.read_parquet(root / "data/04_feature/sids.parquet")
        items = pd.read_parquet(root / "data/03_primary/items.parquet")
        before, after = sid_by_raw_id(first_items, first_sids), sid_by_raw_id(items, sids)
        assert after and all(after[raw] == before[raw] for raw in after if raw in before)
        assert read(root, "sid_report.json")["sid_source"] == "champion"

        second = read(root, "retrain/gate.json")
        assert second["champion_version"] == first["challenger_version"]
        assert second["decision"] in ("promote", "refuse") and second["numbers"]
        # lineage: the warm model's chain reaches the champion's run, and from there the raw files
        client = MlflowClient()
        lines = lineage_lines(
            client, f"models:/{registry.DIFFUSION_MODEL}/{second['challenger_version']}", root
        )
        first_run = client.get_model_version(registry.DIFFUSION_MODEL, first["challenger_version"]).tags[
            "lineage.model.run_id"
        ]
        text = "\n".join(lines)
        assert f"run {first_run}" in text and "node convert_teacher" in text and "(raw file)" in text


INFERENCE: dict[str, Any] = {  # `inference` as the nodes read it: every key, no screen, the least timing
    "splits": ["valid", "test"],
    "max_requests": None,
    "sweep_max_requests": 2,
    "valid_sweep": ["rl"],
    "taus": [0.9, 0.5],
    "taus_by_system": {},
    "operating_point": {
        "systems": [SERVED_DIFFUSION],
        "reference": "ar_rl",
        "n_boot": 100,
        "floor_screen": None,
        "speed_batch_size": 1,
        "taus": [0.9, 0.5],
        "windows": [None, 2],
        "timing": {"n_prompts": 2, "batch_sizes": [1, 2], "rounds": 2, "min_calls": 1, "warmup": 0},
    },
    "decoding": {"max_new_tokens": 8, "batch_size": 4, "constrained": False, "device": "cpu"},
}
POLICY = {  # `policy`: every bar open (untrained models), each case below closes one
    "level": 0.95,
    "min_unforced_rate": 0.0,
    "min_speed_ratio": 0.0,
    "choice_margin": 1.0,
    "gate_margin": 1.0,
    "prerank_margin": 1.0,
}


@pytest.mark.parametrize(
    ("change", "bars"),
    [
        ({}, {}),  # chosen
        ({}, {"choice_margin": -0.5}),  # refused on accuracy, never timed
        ({}, {"prerank_margin": -0.5}),  # refused on the pre-rank, never timed
        ({}, {"min_speed_ratio": 1e9}),  # refused on the timed speed
        ({"floor_screen": {"requests": 2, "z": 1.0}}, {"min_unforced_rate": 0.5}),  # stopped at the screen
        ({"systems": ["rl"]}, {}),  # the served system chooses nothing: {}
    ],
)
def test_the_retrain_chooses_the_operating_point_inference_chooses(
    change: dict[str, Any], bars: dict[str, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`choose_operating_point` (one core call) and inference's nodes (`rerank_ar_rl`, then the
    served system's) on the same models and validation requests: the same record, field for field,
    under clocks whose every reading advances by one (the passes' wall clock and the harness's)."""

    def steady() -> None:
        ticks = itertools.count()
        monkeypatch.setattr(rerank, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))

        def timed(*args: Any, **kwargs: Any) -> Any:
            calls = itertools.count()
            return time_candidates(*args, **(kwargs | {"clock": lambda: float(next(calls))}))

        monkeypatch.setattr(benchmark, "time_candidates", timed)  # what `candidate_timer` binds

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only add contention
    try:
        tokenizer, requests = make_world(n_users=5, splits=("test", "valid"))
        torch.manual_seed(0)
        ar, diffusion = tiny_model_for(tokenizer), tiny_model_for(tokenizer, block_size=4)
        params = copy.deepcopy(INFERENCE)
        params["operating_point"] |= change
        policy = POLICY | bars  # one block, handed to both
        steady()
        retrained = choose_operating_point(diffusion, ar, requests, tokenizer, copy.deepcopy(params), policy)
        steady()
        valid = {**params, "splits": ["valid"]}
        reference = make_rerank_node("ar_rl")(ar, requests, tokenizer, valid, policy)
        point = make_rerank_node(SERVED_DIFFUSION)(
            diffusion, requests, tokenizer, valid, policy, reference, ar
        )["operating_point"]
    finally:
        torch.set_num_threads(threads)
    expected = {} if point is None else {SERVED_DIFFUSION: point}

    def text(record: dict[str, Any]) -> str:  # JSON as operating_point.json holds it (NaN == NaN)
        return json.dumps(record, sort_keys=True, default=str)

    assert text(retrained) == text(expected)
    assert (point is None) == ("systems" in change)
