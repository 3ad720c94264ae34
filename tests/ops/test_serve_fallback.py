"""The day-to-day path always ends serving something and says what: the diffusion champion, else the
teacher's, else the retriever's order; an empty or missing registry is one line and status 1."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest

from diffusion_gr2.__main__ import ops
from diffusion_gr2.core.rank.rerank import SERVED_DIFFUSION
from diffusion_gr2.core.registry import registry
from diffusion_gr2.core.serving.serving import SIGNATURE, RequestError
from diffusion_gr2.pipelines.retrain.nodes import register_models, run_gate
from tests.ops.conftest import DECODING, World
from tests.ops.test_gate import LONG, SERVING, params, policy, registering, requests

REFUSED = {
    SERVED_DIFFUSION: {"tau": None, "window": None, "refused": "own valid rate 0.40 < 0.5 at every tau"}
}
TRACES, INFERENCE = {"prompt": {}}, {"decoding": {**DECODING, **LONG}}


def register_and_gate(world: World, tmp_path: Path, points: dict, **bars: float) -> dict:
    """Register, then gate under `policy(**bars)`."""
    retrain = params(tmp_path) | {"register": registering(world)}
    versions = register_models(None, None, world.items, world.sids, points, retrain, TRACES, INFERENCE)
    return run_gate(versions, requests(world), retrain, SERVING, policy(**bars))["gate_report"]


def which(capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()  # what registering logged
    assert ops(["serve", "--which"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.count("\n") == 1
    return out.strip()


def test_refused_rl_and_teacher_serve_the_prerank_in_the_same_format(
    store: str, world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = register_and_gate(world, tmp_path, REFUSED, min_unforced_rate=0.5)
    assert report["decision"] == "not_registered" and report["teacher_gate"]["decision"] == "refuse"
    line = which(capsys)
    assert line.startswith(f"serving {registry.PRERANK_MODEL} v1 (the retriever's order (pre-rank)): ")
    assert "diffusion-gr2 has no version" in line and "gate refuse: unforced_rate" in line

    model = mlflow.pyfunc.load_model(f"models:/{registry.PRERANK_MODEL}@{registry.CHAMPION}")
    request = requests(world).iloc[0]
    answer = model.predict([{"history": request["history"], "candidates": request["candidates"]}])
    assert list(answer.columns) == SIGNATURE.outputs.input_names()  # the re-rankers' response format
    row = answer.iloc[0]
    assert list(row["ranking"]) == request["candidates"] and row["system"] == "prerank" and row["valid"]
    assert "retriever's order" in row["explanation"]
    with pytest.raises(RequestError, match="unknown candidate"):
        model.predict([{"history": request["history"], "candidates": ["nope", request["candidates"][0]]}])


def test_a_passing_teacher_serves_until_a_diffusion_model_passes(
    store: str, world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # random tiny models are held to no floor here: the teacher passes its own gate
    report = register_and_gate(world, tmp_path, REFUSED, margin=1.0)
    assert report["teacher_gate"]["decision"] == "promote"
    assert {c["name"] for c in report["teacher_gate"]["checks"]} == {
        "unforced_rate",
        "recall@1_vs_prerank.low",
    }
    assert registry.alias_version(registry.PRERANK_MODEL, registry.CHAMPION) is None
    line = which(capsys)
    assert line.startswith(
        f"serving {registry.TEACHER_MODEL} v1 (the AR teacher): diffusion-gr2 has no version"
    )

    # the next registration has an operating point and passes: the diffusion model serves; the new
    # teacher is compared with the teacher's champion
    report = register_and_gate(world, tmp_path, {SERVED_DIFFUSION: {"tau": 0.9, "window": None}}, margin=1.0)
    assert report["decision"] == "promote" and report["teacher_gate"]["champion_version"] == "1"
    assert "recall@1_vs_champion.low" in {c["name"] for c in report["teacher_gate"]["checks"]}
    assert which(capsys) == f"serving {registry.DIFFUSION_MODEL} v1 (the diffusion re-ranker): its champion"
    capsys.readouterr()
    assert ops(["registry", "show"]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[-1].startswith(f"serving {registry.DIFFUSION_MODEL} v1")
    assert any(s.startswith(f"{registry.PRERANK_MODEL} v2  aliases challenger") for s in shown)


OPS = [
    ["registry", "show"],
    ["registry", "rollback", registry.DIFFUSION_MODEL],
    ["registry", "promote", registry.DIFFUSION_MODEL, "1"],
    ["lineage", f"models:/{registry.DIFFUSION_MODEL}@champion"],
    ["serve"],
    ["serve", "--which"],
]


@pytest.mark.parametrize("argv", OPS, ids=" ".join)
def test_every_ops_command_on_an_empty_registry_is_one_line_and_status_1(
    store: str, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert ops(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert registry.DIFFUSION_MODEL in err


@pytest.mark.parametrize("argv", OPS, ids=" ".join)
def test_every_ops_command_on_a_missing_registry_is_one_line_and_status_1(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    assert ops(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == f"no MLflow store at sqlite:///{db}: run `make run`, then `make register`\n"
    assert not db.exists()  # asking creates no store


def test_the_run_summary_names_what_will_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    reporting = tmp_path / "08_reporting"
    reporting.mkdir()
    (reporting / "operating_point.json").write_text(
        json.dumps({SERVED_DIFFUSION: {"tau": None, "refused": "own valid 0.40 < 0.5"}})
    )
    assert ops(["summary", "--reporting", str(reporting)]) == 0
    out = capsys.readouterr().out
    assert out == (
        f"Will serve: '{SERVED_DIFFUSION}' has no operating point: own valid 0.40 < 0.5: `make register` gates the teacher "
        "ar_rl alone (the pre-rank serves if it fails); now nothing registered yet\n"
    )
    (reporting / "operating_point.json").write_text(
        json.dumps({SERVED_DIFFUSION: {"tau": 0.75, "window": None}})
    )
    assert ops(["summary", "--reporting", str(reporting)]) == 0
    assert capsys.readouterr().out.startswith(
        f"Will serve: {SERVED_DIFFUSION} has an operating point (tau 0.75, whole block): `make register` gates it and the teacher"
    )
