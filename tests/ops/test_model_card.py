"""The model card of a registered version (`core.lineage.model_card`): every fact from a recorded file."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest

from diffusion_gr2.__main__ import ops
from diffusion_gr2.core.evaluate.policy import Policy
from diffusion_gr2.core.lineage.lineage import PRODUCED_TAG, DigestCache, NodeRecord, file_md5, log_record
from diffusion_gr2.core.lineage.model_card import CardConfig, publish_cards, read_card
from diffusion_gr2.core.registry import registry
from diffusion_gr2.core.registry.gate import GateConfig, decide
from tests.ops.conftest import World
from tests.ops.test_retrain_command import HEADER


def write_json(path: Path, data: object) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return file_md5(path)


def gate_result(version: str) -> dict:
    """A real gate report (`gate.decide`) on 20 requests; one timing round, so the speed check fails."""
    side = {"hits": [1, 0] * 10, "recall@1": 0.5, "valid_rate": 1.0, "unforced_rate": 0.8, "n": 20}
    teacher = side | {"hits": [0, 1] * 10, "unforced_rate": 0.6, "output_tokens_per_s": 100.0}
    prerank = {"hits": [1, 1, 0, 0] * 5, "recall@1": 0.5}
    config = GateConfig(**{"slice_share": 0.5, "max_requests": 20, "speed_batch_size": 1, "speed_requests": 4,
                           "speed_rounds": 6}, policy=Policy(gate_margin=0.05, min_unforced_rate=0.5,
                                                             min_speed_ratio=1.0))  # fmt: skip
    report = decide(side | {"output_tokens_per_s": 150.0}, None, teacher, prerank, config, list(range(20)))
    return report | {"challenger_version": version, "teacher_version": None, "teacher_gate": None}


def test_the_card_states_what_the_run_recorded_and_leaves_out_another_runs_table(
    store: str, world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    reporting = tmp_path / "data/08_reporting"
    raw = tmp_path / "data/01_raw/ml-100k/ml-100k.inter"
    raw.parent.mkdir(parents=True)
    # 2001-09-09 and 2001-09-10 (unix 1e9 and a day later)
    raw.write_text(f"{HEADER}\n1\t10\t4\t1000000000\n2\t11\t5\t1000086400\n")
    with mlflow.start_run(run_name="an older run") as older:  # wrote the stage table, for other models
        stage_md5 = write_json(
            reporting / "stage_metrics.json",
            [{"system": "rl", "tau": 0.75, "split": "test", "n": 99, "recall@1": 0.4242, "ci": {}}],
        )
        mlflow.set_tag(f"{PRODUCED_TAG}{stage_md5}", "stage_metrics")
    model_digest = DigestCache().digest(world.models["rl"])
    with mlflow.start_run(run_name="train") as run:
        mlflow.set_tags({"git_commit": "0123456789abcdef", "git_dirty": "false"})
        mlflow.log_param("rl.train.max_steps", 80)
        produced = {
            "data_stats": write_json(
                reporting / "data_stats.json",
                {"users": 7, "items": 13, "interactions": 321, "rows_read": 330, "rows_rejected": 9,
                 "median_history": 17.0, "splits": {"train": 300, "valid": 7, "test": 7}},
            ),
            "training_rl": write_json(
                reporting / "training/rl.json",
                {"steps": 80, "final_loss": 0.1234, "train_seconds": 55.5, "resumed_from_step": 0},
            ),
            "operating_point": write_json(
                reporting / "operating_point.json",
                {"rl": {"tau": 0.75, "window": None, "budget": 0.03, "candidates": []}},
            ),
        }  # fmt: skip
        mlflow.set_tags({f"{PRODUCED_TAG}{md5}": name for name, md5 in produced.items()})
        record = NodeRecord("prepare_and_train", params=["data_prep"])
        record.inputs["raw/ml-100k.inter"] = {"path": str(raw), "digest": file_md5(raw)}
        record.outputs["model_rl"] = {"path": str(world.models["rl"]), "digest": model_digest}
        log_record(record)
        tags = {
            "lineage.model.name": "model_rl",
            "lineage.model.path": str(world.models["rl"]),
            "lineage.model.digest": model_digest,
            "lineage.model.run_id": run.info.run_id,
            "operating_point.source": "operating_point.json (validation)",
        }
        ref = registry.register_reranker(
            registry.DIFFUSION_MODEL, world.models["rl"], world.items, world.sids, world.config("rl"), tags
        )
        cards = publish_cards(gate_result(ref.version), config=CardConfig(str(reporting)))
    card = read_card(registry.DIFFUSION_MODEL, ref.version)
    assert cards == {registry.DIFFUSION_MODEL: card}
    assert f"trained by run `{run.info.run_id}` at commit `0123456789ab`" in card
    assert "7 users, 13 items, 321 interactions after filtering (330 rows read, 9 rejected)" in card
    assert "Window: 2001-09-09 to 2001-09-10 (2 raw rows in 1 files" in card
    assert f"`raw/ml-100k.inter` md5 `{file_md5(raw)}` [ok]" in card
    assert "| rl | 80 | 0.1234 | 55.5 | 0 |" in card and "`rl.train.max_steps` 80" in card
    assert "Rule and choice on validation: tau 0.75, window None, budget 0.03." in card
    # the stage table was another run's: named, its figures left out
    assert f"not this model's (written by run {older.info.run_id})" in card and "0.424" not in card
    # the gate's checks, each with its figure; one timing round cannot cover 95%: refused
    assert "## Gate: refuse" in card and "| speed_ratio_vs_ar_rl.low | 1.5000 | 1.0000 | NO |" in card
    assert "| unforced_rate | 0.8000 | 0.5000 | yes |" in card
    assert "without the grammar 0.800 of its answers are valid" in card and "MovieLens-100k" in card
    # the CLI shows the stored card; a version without one is one line and status 1
    registry.promote(registry.DIFFUSION_MODEL, ref.version, "test")
    assert ops(["registry", "show", "--card"]) == 0
    bare = registry.register_reranker(
        registry.DIFFUSION_MODEL, world.models["rl"], world.items, world.sids, world.config("rl")
    )
    assert ops(["registry", "show", registry.DIFFUSION_MODEL, "--card", bare.version]) == 1


def test_the_cli_prints_the_card(
    store: str, world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    ref = registry.register_reranker(
        registry.DIFFUSION_MODEL, world.models["rl"], world.items, world.sids, world.config("rl")
    )
    publish_cards(gate_result(ref.version), config=CardConfig(str(tmp_path / "none")))
    # refused, so no champion yet: the error says how to read the version's card instead
    capsys.readouterr()
    assert ops(["registry", "show", "--card"]) == 1
    err = capsys.readouterr().err
    assert "no alias 'champion'" in err and "registry show diffusion-gr2 --card VERSION_OR_ALIAS" in err
    registry.promote(registry.DIFFUSION_MODEL, ref.version, "test")
    capsys.readouterr()  # the promotion's log line
    assert ops(["registry", "show", "--card"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# Model card: diffusion-gr2 version {ref.version}")
    # nothing recorded by a Kedro run: the card says so rather than inventing figures
    assert "* none on record" in out and "`" + str(tmp_path / "none/data_stats.json") + "` is absent" in out
