"""End-to-end: `inference` + `evaluation` through a Kedro session on tiny random models (smoke env)."""

from __future__ import annotations

import json
import shutil
import statistics
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import torch
import yaml

from diffusion_gr2.core.base.manifest import read_report
from diffusion_gr2.core.bench.benchmark import BENCHMARK_KEYS
from diffusion_gr2.core.evaluate.metrics import METRICS
from diffusion_gr2.core.evaluate.rankings import stage_metrics
from diffusion_gr2.core.model.factory import save_model
from diffusion_gr2.core.rank.rerank import AR_SYSTEMS, DIFFUSION_SYSTEMS, SYSTEMS
from tests.conftest import empty_mlflow_store, isolated_project, run_kedro
from tests.core.model.tiny import tiny_model_for
from tests.core.rank.world import analyst_inputs, make_world

N_USERS, SMOKE_USERS, SMOKE_TAUS = 10, 8, [0.9]  # smoke params: max_users 8, taus [0.9]
OPERATING_POINT_SYSTEMS = ("distilled",)  # base (smoke inherits): inference.operating_point.systems
VALID_SWEEP = ("rl",)  # base (smoke inherits): inference.valid_sweep


def _catalog(project: Path) -> dict[str, dict]:
    catalog: dict[str, dict] = {}
    for path in (project / "conf/base").glob("catalog*.yml"):
        catalog |= yaml.safe_load(path.read_text()) or {}
    return catalog


def _model_dirs(project: Path) -> dict[str, Path]:
    """Where the catalog keeps each system's model."""
    catalog = _catalog(project)
    return {s: project / catalog[f"model_{s}"]["filepath"] for s in (*AR_SYSTEMS, *DIFFUSION_SYSTEMS)}


def _write_inputs(project: Path) -> None:
    """Tokenizer, requests, one tiny random model per system, and what the analyst's rows read (the
    candidates, training sequences, items and evidence), where the catalog expects them."""
    tokenizer, requests = make_world(n_users=N_USERS, splits=("test", "valid"))
    tokenizer.save_pretrained(project / "data/06_models/tokenizer")
    requests.to_parquet(project / "data/05_model_input/requests.parquet")
    catalog = _catalog(project)
    for name, value in analyst_inputs(n_users=N_USERS, splits=("test", "valid")).items():
        path = project / catalog[name]["filepath"]
        if isinstance(value, pd.DataFrame):
            value.to_parquet(path)
        else:
            path.write_text(json.dumps(value))
    for system, path in _model_dirs(project).items():
        save_model(tiny_model_for(tokenizer, None if system in AR_SYSTEMS else 4), tokenizer, path)


@pytest.fixture(scope="module")
def evaluation_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with isolated_project(tmp_path_factory.mktemp("evaluation_project")) as root:
        _write_inputs(root)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            run_kedro(root, ["inference", "evaluation"])
        finally:
            torch.set_num_threads(threads)
        yield root


@pytest.mark.slow
def test_rankings_hold_every_system_and_tau(evaluation_run: Path) -> None:
    rankings = pd.read_parquet(evaluation_run / "data/07_model_output/rankings.parquet")
    points = read_report(evaluation_run / "data/08_reporting/operating_point.json")[0]
    assert set(points) == set(OPERATING_POINT_SYSTEMS)  # smoke: operating_point.systems
    sweep = [(s, None, None) for s in ("prerank", "analyst", *AR_SYSTEMS)] + [
        (s, t, None) for s in DIFFUSION_SYSTEMS for t in SMOKE_TAUS
    ]
    # validation: the pre-rank, the analyst, the reference, the choosing systems and valid_sweep;
    # test: every one
    on_valid = {"prerank", "analyst", "ar_rl", *OPERATING_POINT_SYSTEMS, *VALID_SWEEP}
    expected = [("valid", *v) for v in sweep if v[0] in on_valid] + [("test", *v) for v in sweep]
    for system in OPERATING_POINT_SYSTEMS:
        point = points[system]
        chosen = (point["tau"], point["window"])
        assert chosen in {(0.9, None), (0.9, 4)} and point["split"] == "valid"
        assert len(point["candidates"]) == 2  # smoke: taus [0.9] x windows [null, 4]
        for c in point["candidates"]:  # each paired with ar_rl on the same validation requests
            assert c["recall@1_vs_ar_rl.n"] == SMOKE_USERS
            assert c["recall@1_vs_ar_rl.low"] <= c["recall@1_vs_ar_rl"] <= c["recall@1_vs_ar_rl.high"]
        expected.append(("valid", system, 0.9, 4))  # the operating-point grid
        expected += [("test", system, *chosen)] if chosen[1] else []
    groups = rankings.groupby(["split", "system", "tau", "window"], sort=False, dropna=False).size()
    got = [(sp, s, None if pd.isna(t) else t, None if pd.isna(w) else int(w)) for sp, s, t, w in groups.index]
    assert sorted(got, key=str) == sorted(expected, key=str)
    assert (groups == SMOKE_USERS).all()
    assert sorted(rankings["user_id"].unique()) == list(range(SMOKE_USERS))  # the first users by id
    assert (rankings["output_tokens"] <= 160).all()
    assert rankings["valid"].all()  # served under the answer grammar: the fallback is tested below


@pytest.fixture(scope="module")
def free_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`inference` with free decoding (no grammar): the tiny random models write invalid answers."""
    with isolated_project(tmp_path_factory.mktemp("free_decoding_project")) as root:
        _write_inputs(root)
        params_file = root / "conf/smoke/parameters_inference.yml"
        params = yaml.safe_load(params_file.read_text())
        params["inference"]["decoding"]["constrained"] = False
        params_file.write_text(yaml.safe_dump(params))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            run_kedro(root, ["inference"])
        finally:
            torch.set_num_threads(threads)
        yield root


@pytest.mark.slow
def test_invalid_answers_are_served_the_prerank_and_counted(free_run: Path) -> None:
    rankings = pd.read_parquet(free_run / "data/07_model_output/rankings.parquet")
    invalid = rankings[~rankings["valid"]]
    assert len(invalid) > 0 and set(invalid["system"]) <= {*AR_SYSTEMS, *DIFFUSION_SYSTEMS}
    assert (invalid["ranking"].map(list) == invalid["prerank"].map(list)).all()  # fallback served
    assert (invalid["reason"] != "ok").all() and (invalid["forced"] == 0).all()
    rows = stage_metrics(rankings, n_boot=10, seed=0)  # one row per (split, system, tau, window)
    assert sum(r["n"] for r in rows) == len(rankings)
    assert sum(r["n"] * r["fallback_rate"] for r in rows) == pytest.approx(len(invalid))  # all counted


@pytest.mark.slow
def test_stage_metrics_file_is_recomputable_from_rankings(evaluation_run: Path) -> None:
    rows = read_report(evaluation_run / "data/08_reporting/stage_metrics.json")[0]
    assert all(list(r) == ["system", "tau", "window", "split", "n", *METRICS, "ci"] for r in rows)
    assert [r["system"] for r in rows if r["split"] == "test" and r["window"] is None] == list(SYSTEMS)
    rankings = pd.read_parquet(evaluation_run / "data/07_model_output/rankings.parquet")
    assert stage_metrics(rankings, n_boot=200, seed=0) == rows  # smoke: 200 resamples, seed 0
    comparisons = read_report(evaluation_run / "data/08_reporting/comparisons.json")[0]
    assert {c["baseline"] for c in comparisons} == {"ar_rl", "prerank"}
    assert {(c["split"], c["baseline"]) for c in comparisons if c["system"] == "analyst"} == {
        (split, base) for split in ("valid", "test") for base in ("ar_rl", "prerank")
    }
    table = (evaluation_run / "data/08_reporting/stage_metrics.md").read_text()
    assert all(f"| {s} |" in table for s in SYSTEMS)
    for plot in ("recall_at_1.png", "valid_rate.png"):
        assert (evaluation_run / "data/08_reporting/plots" / plot).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_report_names_the_files_this_run_lacks(evaluation_run: Path) -> None:
    """This world has no data_prep, semantic_ids or retrieval reports and no benchmark: each is named."""
    report = (evaluation_run / "data/08_reporting/report.md").read_text()
    for name, command in (
        ("data_stats.json", "kedro run --pipelines data_prep"),
        ("benchmark.json", "make benchmark"),
    ):
        assert f"*`{name}` is absent from this run: `{command}` writes it.*" in report
    assert "## Stage table (test)" in report and "## Reasoning quality (test" in report
    stage = report.split("## Stage table (test)")[1].split("\n## ")[0]
    assert "| prerank | — | — |" in stage and "| analyst | — | — |" in stage  # the teacher's ceiling
    reasoning = read_report(evaluation_run / "data/08_reporting/reasoning_metrics.json")[0]
    assert {r["system"] for r in reasoning} == {
        *AR_SYSTEMS,
        *DIFFUSION_SYSTEMS,
    }  # every model, not the pre-rank
    assert (evaluation_run / "data/08_reporting/report.html").read_text().startswith("<!DOCTYPE html>")


@pytest.mark.slow
def test_evaluation_is_logged_to_mlflow(evaluation_run: Path) -> None:
    mlflow.set_tracking_uri(f"sqlite:///{evaluation_run / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["diffusion-gr2"], output_format="list")
    (run,) = [r for r in runs if r.data.tags.get("pipeline") == "inference,evaluation"]
    rows = read_report(evaluation_run / "data/08_reporting/stage_metrics.json")[0]
    cft = next(r for r in rows if r["system"] == "cft" and r["split"] == "test")
    assert run.data.metrics["eval.cft.tau0.9.recall_at_1"] == pytest.approx(cft["recall@1"])
    assert (
        "eval.ar_rl.valid_rate" in run.data.metrics
        and "eval.cmp.rl.tau0.9.vs_prerank.ndcg_at_3" in run.data.metrics
    )
    assert "inference.cft.tau0.9.mean_nfe" in run.data.metrics
    client = mlflow.MlflowClient()
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"stage_metrics.json", "comparisons.json", "stage_metrics.md", "plots"} <= artifacts
    assert {"reasoning_metrics.json", "report.md", "report.html"} <= artifacts
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert plots == {
        f"plots/{name}.png"
        for name in ("recall_at_1", "valid_rate", "frontier", "own_valid_rate", "training_curves")
    }


# The operating points the benchmark reads: cft at a whole-block tau, rl and distilled with a window,
# opd refused.
OPERATING_POINTS = {
    "cft": {"tau": 0.9, "window": None, "refused": None},
    "opd": {"tau": None, "window": None, "refused": "no (tau, window) reaches R@1 0.500 on validation"},
    "rl": {"tau": 0.9, "window": 2, "refused": None},
    "distilled": {"tau": 0.9, "window": 2, "refused": None},
}


@pytest.fixture(scope="module")
def benchmark_run(evaluation_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`benchmark` on a copy of the evaluated project (its own MLflow store) with known operating points."""
    root = tmp_path_factory.mktemp("benchmark_project") / "project"
    shutil.copytree(evaluation_run, root, ignore=shutil.ignore_patterns("mlflow.db", "mlruns", "mlartifacts"))
    (root / "data/08_reporting/operating_point.json").write_text(json.dumps(OPERATING_POINTS))
    threads = torch.get_num_threads()  # the benchmark sets the process's thread count
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.setenv("MLFLOW_TRACKING_URI", empty_mlflow_store(root / "mlflow.db"))
        try:
            run_kedro(root, ["benchmark"])
        finally:
            torch.set_num_threads(threads)
        yield root


@pytest.mark.slow
def test_benchmark_pipeline_times_ar_generate_and_each_operating_point(benchmark_run: Path) -> None:
    rows = read_report(benchmark_run / "data/08_reporting/benchmark.json")[0]
    assert all(list(r) == list(BENCHMARK_KEYS) for r in rows)
    lines = [
        ("ar_rl", None, None),
        ("generate", None, None),
        ("cft", 0.9, None),
        ("opd", 0.9, None),  # refused: timed at the unserved tau, not marked served
        ("rl", 0.9, 2),
        ("distilled", 0.9, 2),
    ]
    expected = [(*line, c, b) for line in lines for c in (True, False) for b in (1, 4)]  # smoke: 1 and 4
    # after the AR lines, the served system drafting for ar_rl (lossless, batch 1, both flags)
    expected[8:8] = [("ar_rl+distilled-draft", None, None, c, 1) for c in (True, False)]
    expected.append(("distilled", 0.9, None, True, 1))  # the sweep (smoke: tau 0.9, batch 1, as served)
    assert [(r["system"], r["tau"], r["window"], r["constrained"], r["batch_size"]) for r in rows] == expected
    assert [r["operating_point"] for r in rows] == [True] * 14 + [False] * 4 + [True] * 8 + [False]
    for c in (True, False):  # the drafted row writes ar_rl's tokens, in fewer forwards
        plain, drafted = (
            next(r for r in rows if r["system"] == s and r["constrained"] == c and r["batch_size"] == 1)
            for s in ("ar_rl", "ar_rl+distilled-draft")
        )
        assert drafted["mean_output_tokens"] == plain["mean_output_tokens"]
        assert drafted["nfe_per_sample"] <= plain["nfe_per_sample"]
    assert all(0 < r["mean_output_tokens"] <= 160 and r["output_tokens_per_s"] > 0 for r in rows)
    for r in rows:  # speed-ups against ar_rl at the same batch size and grammar flag, in this run
        ref = next(
            a
            for a in rows
            if a["system"] == "ar_rl"
            and (a["batch_size"], a["constrained"]) == (r["batch_size"], r["constrained"])
        )
        paired = [
            x / y for x, y in zip(r["tokens_per_s_by_round"], ref["tokens_per_s_by_round"], strict=True)
        ]
        assert r["speedup_vs_ar"] == pytest.approx(statistics.median(paired))  # paired by round
        assert min(paired) <= r["speedup_vs_ar_low"] <= r["speedup_vs_ar"] <= r["speedup_vs_ar_high"]
        assert r["statistic"].startswith("median of ") and "speed-up interval" in r["statistic"]
    by_length = read_report(benchmark_run / "data/08_reporting/speedup_by_length.json")[0]
    # the length sweep: every served line (and opd's unserved one) under the smoke budgets and its own
    assert {(r["system"], r["budget"]) for r in by_length} == {
        (s, b) for s in ("ar_rl", "cft", "opd", "rl", "distilled") for b in (64, 96, 160)
    }
    for name in ("speedup_by_batch", "speedup_by_length"):
        assert (benchmark_run / f"data/08_reporting/plots/{name}.png").read_bytes()[:4] == b"\x89PNG"
    mlflow.set_tracking_uri(f"sqlite:///{benchmark_run / 'mlflow.db'}")
    (run,) = mlflow.search_runs(experiment_names=["diffusion-gr2"], output_format="list")
    assert "bench.rl.tau0.9.w2.b4.grammar.speedup_vs_ar" in run.data.metrics
    assert "bench.rl.tau0.9.w2.b4.grammar.speedup_vs_ar_low" in run.data.metrics
    plots = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "plots")}
    assert {"plots/speedup_by_batch.png", "plots/speedup_by_length.png"} <= plots
    report = (benchmark_run / "data/08_reporting/report.md").read_text()  # re-rendered with the table
    assert "## Decode benchmark" in report and "`benchmark.json` is absent" not in report
    assert "](plots/speedup_by_batch.png)" in report and "](plots/speedup_by_length.png)" in report


# ---- every report scoped to its run (issue 43 item 2) ---------------------------------------------------


def _tracked_run(project: Path, pipeline: str) -> str:
    """The id of the MLflow run of `project`'s store tagged with `pipeline`."""
    mlflow.set_tracking_uri(f"sqlite:///{project / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["diffusion-gr2"], output_format="list")
    (run,) = [r for r in runs if r.data.tags.get("pipeline") == pipeline]
    return run.info.run_id


@pytest.mark.slow
def test_each_report_names_its_run_and_the_models_it_measured(evaluation_run: Path) -> None:
    from diffusion_gr2.core.evaluate.results import results_markdown
    from diffusion_gr2.core.lineage.lineage import DigestCache

    reporting = evaluation_run / "data/08_reporting"
    run_id = _tracked_run(evaluation_run, "inference,evaluation")
    digests, models = DigestCache(), _model_dirs(evaluation_run)
    for name in ("stage_metrics", "comparisons", "operating_point", "reasoning_metrics"):
        _, manifest = read_report(reporting / f"{name}.json")
        assert manifest is not None and manifest.run_id == run_id
        assert (manifest.env, manifest.pipelines, manifest.partial) == (
            "smoke",
            ("inference", "evaluation"),
            False,
        )
        # the weights inference decoded, by content: a retrained model would not match
        assert {f"model_{s}": digests.digest(p) for s, p in models.items()}.items() <= manifest.models.items()
    line = results_markdown(reporting).rstrip().splitlines()[-1]
    assert (
        line.startswith(
            f"Run: stage_metrics.json, comparisons.json, operating_point.json: run {run_id[:8]} ("
        )
        and "env smoke, pipelines inference, evaluation)" in line
    )
    assert line.endswith(" min.")  # its minutes: node_times.inference+evaluation.json names the run


@pytest.mark.slow
def test_after_a_partial_rerun_results_show_each_figure_with_its_run(
    evaluation_run: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`kedro run --pipelines evaluation` rewrites stage_metrics and comparisons; the operating point
    stays the first run's: `make results` and the report say so, a line per run."""
    from diffusion_gr2.core.evaluate.results import MixedRunsError, results_markdown

    first = _tracked_run(evaluation_run, "inference,evaluation")
    root = tmp_path_factory.mktemp("rerun_project") / "project"
    shutil.copytree(evaluation_run, root, ignore=shutil.ignore_patterns("mlflow.db", "mlruns", "mlartifacts"))
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.setenv("MLFLOW_TRACKING_URI", empty_mlflow_store(root / "mlflow.db"))
        run_kedro(root, ["evaluation"])
    second = _tracked_run(root, "evaluation")
    reporting = root / "data/08_reporting"
    table = results_markdown(reporting)
    assert "Runs (the figures come from 2 runs):" in table
    assert f"* stage_metrics.json, comparisons.json: run {second[:8]} (" in table
    assert f"* operating_point.json: run {first[:8]} (" in table
    assert "pipelines evaluation)" in table and "Mixed models" not in table  # same weights
    with pytest.raises(MixedRunsError):
        results_markdown(reporting, strict=True)
    report = (reporting / "report.md").read_text()
    assert f"* stage_metrics.json, comparisons.json, reasoning_metrics.json: run {second[:8]} (" in report
    assert f"* operating_point.json: run {first[:8]} (" in report


@pytest.mark.slow
def test_the_benchmark_report_names_the_benchmark_run_beside_the_evaluation_one(benchmark_run: Path) -> None:
    from diffusion_gr2.core.evaluate.results import results_markdown

    reporting = benchmark_run / "data/08_reporting"
    bench = _tracked_run(benchmark_run, "benchmark")
    for name in ("benchmark", "speedup_by_length"):
        _, manifest = read_report(reporting / f"{name}.json")
        assert manifest is not None and manifest.run_id == bench and manifest.node == "benchmark_decoding"
        assert set(manifest.models) == {f"model_{s}" for s in ("ar_rl", "cft", "opd", "rl", "distilled")}
    table = results_markdown(reporting)
    assert f"* benchmark.json: run {bench[:8]} (" in table
    assert "* operating_point.json: no run record" in table  # the fixture wrote it by hand
    assert "Mixed models" not in table  # the benchmark timed the weights inference decoded
    report = (reporting / "report.md").read_text()
    assert f"* benchmark.json, speedup_by_length.json: run {bench[:8]} (" in report
