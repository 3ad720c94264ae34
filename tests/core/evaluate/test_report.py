"""The run report from hand-made files: sections, absent files, joins, HTML, MLflow curves."""

from __future__ import annotations

import math
from pathlib import Path

import mlflow
import pandas as pd
import pytest

from diffusion_gr2.core.base.manifest import RunManifest, RunSources
from diffusion_gr2.core.evaluate import report as R
from tests.conftest import empty_mlflow_store

CI = {
    m: [0.1, 0.6]
    for m in ("recall@1", "recall@3", "recall@5", "ndcg@3", "ndcg@5", "mrr", "valid_rate", "unforced_rate")
}


def _stage(system: str, tau: float | None, window: int | None = None, r1: float = 0.2) -> dict:
    metrics = dict.fromkeys(CI, 0.5) | {"recall@1": r1}
    return {"system": system, "tau": tau, "window": window, "split": "test", "n": 10, **metrics, "ci": CI}


STAGES = [_stage("prerank", None, r1=0.19), _stage("analyst", None, r1=0.3), _stage("ar_rl", None, r1=0.2),
          _stage("rl", 0.9, r1=0.21), _stage("rl", 0.4, 4, r1=0.15)]  # fmt: skip


def _rankings() -> pd.DataFrame:
    rows = []
    for system, tau, window, tokens, nfe in (
        ("prerank", math.nan, math.nan, 0, 0),
        ("analyst", math.nan, math.nan, 0, 0),
        ("ar_rl", math.nan, math.nan, 100, 100),
        ("rl", 0.9, math.nan, 100, 40),
        ("rl", 0.4, 4.0, 100, 25),
    ):
        rows += [
            {
                "split": "test",
                "system": system,
                "tau": tau,
                "window": window,
                "output_tokens": tokens,
                "nfe": nfe,
            }
        ] * 2
    rows.append(
        {"split": "test", "system": "rl", "tau": 0.9, "window": math.nan, "output_tokens": 20, "nfe": 10}
    )
    return pd.DataFrame(rows)


def _bench(
    system: str, tau: float | None, window: int | None, batch: int, constrained: bool, tps: float
) -> dict:
    return {
        "system": system, "tau": tau, "window": window, "operating_point": True, "batch_size": batch,
        "constrained": constrained, "backend": "eager", "output_tokens_per_s": tps, "nfe_per_sample": 10.0,
        "tokens_per_forward": 2.0, "latency_p50_ms": 1.0, "latency_p95_ms": 2.0, "mean_output_tokens": 100.0,
        "device": "cpu", "speedup_vs_ar": None if system == "ar_rl" else tps / 100.0,
        "speedup_vs_ar_low": None if system == "ar_rl" else tps / 110.0,
        "speedup_vs_ar_high": None if system == "ar_rl" else tps / 90.0,
        "statistic": "median of 4 interleaved rounds; speed-up interval: per-round ratios ranked 1 and 4 of 4 (87.5%)",
    }  # fmt: skip


def _inputs(**files) -> R.ReportInputs:
    return R.ReportInputs(STAGES, [], [], R.decoding_stats(_rankings()), **files)


def test_decoding_stats_count_all_tokens_over_all_forwards() -> None:
    stats = {(d["system"], d["tau"], d["window"]): d for d in R.decoding_stats(_rankings())}
    assert stats[("rl", 0.9, None)]["tokens_per_forward"] == pytest.approx(220 / 90)
    assert stats[("rl", 0.4, 4)]["tokens_per_forward"] == 4.0 and stats[("rl", 0.9, None)]["n"] == 3
    assert stats[("prerank", None, None)]["tokens_per_forward"] == 0.0


def test_frontier_points_take_tokens_per_s_at_batch_1_under_the_grammar_only() -> None:
    bench = [
        _bench("ar_rl", None, None, 1, True, 100.0),
        _bench("ar_rl", None, None, 16, True, 900.0),
        _bench("rl", 0.9, None, 1, False, 300.0),  # free decoding: not what is served
        _bench("rl", 0.4, 4, 1, True, 250.0),
        _bench("generate", None, None, 1, True, 80.0),  # no accuracy row of its own
    ]
    points = {(p["system"], p["tau"], p["window"]): p for p in R.frontier_points(_inputs(benchmark=bench))}
    assert set(points) == {
        ("ar_rl", None, None),
        ("rl", 0.9, None),
        ("rl", 0.4, 4),
    }  # neither the prerank nor the analyst decodes anything
    assert (
        points[("ar_rl", None, None)]["tokens_per_s"] == 100.0
        and points[("rl", 0.4, 4)]["tokens_per_s"] == 250.0
    )
    assert points[("rl", 0.9, None)]["tokens_per_s"] is None
    assert points[("rl", 0.4, 4)]["recall@1"] == 0.15 and points[("rl", 0.4, 4)]["tokens_per_forward"] == 4.0


def test_absent_files_are_named_with_the_command_that_writes_them() -> None:
    inputs = _inputs()
    figures = R.report_figures(inputs)
    assert set(figures) == {"frontier", "own_valid_rate", "training_curves"}  # no benchmark: no batch plot
    text = R.render_markdown(inputs, figures)
    for name, command in (
        ("data_stats.json", "kedro run --pipelines data_prep"),
        ("sid_report.json", "kedro run --pipelines semantic_ids"),
        ("retrieval_report.json", "kedro run --pipelines retrieval"),
        ("benchmark.json", "make benchmark"),
        ("operating_point.json", "kedro run --pipelines inference"),
    ):
        assert f"*`{name}` is absent from this run: `{command}` writes it.*" in text
    assert "| rl | 0.4 | 4 |  | 10 | 0.1500 [0.100, 0.600] |" in text  # a stage row, with its interval
    assert "| prerank | — | — |  | 10 |" in text and text.count("](plots/") == 3
    # the teacher's ceiling beside the pre-rank: no tokens per forward, named in the table's note
    stage = text.split("## Stage table (test)")[1].split("\n## ")[0]
    systems = [line.split(" | ")[0].lstrip("| ") for line in stage.splitlines() if line.startswith("| ")]
    assert systems[1:4] == ["prerank", "analyst", "ar_rl"]  # after the header
    assert "| analyst | — | — |  | 10 | 0.3000 [0.100, 0.600] |" in stage
    assert next(line for line in stage.splitlines() if line.startswith("| analyst |")).endswith("| — |")
    assert "*analyst*: the learned analyst's noiseless order" in stage


def test_benchmark_rows_make_a_table_and_a_batch_plot() -> None:
    bench = [_bench("ar_rl", None, None, b, True, 100.0 * b) for b in (1, 4)]
    bench += [_bench("rl", 0.9, None, b, True, 150.0 * b) for b in (1, 4)]
    inputs = _inputs(benchmark=bench, operating_point={"rl": {"tau": 0.9, "window": None, "budget": 0.01}})
    figures = R.report_figures(inputs)
    text = R.render_markdown(inputs, figures)
    assert "speedup_by_batch" in figures and "](plots/speedup_by_batch.png)" in text
    assert (
        "| rl | 0.9 | — | yes | 4 | grammar | 600.0 | 10.00 | 2.000 | 1.0 | 2.0 | 100.0 | 6.0000 [5.455, 6.667] |"
        in text
    )
    assert "Tokens/s and speed-ups: median of 4 interleaved rounds; speed-up interval:" in text  # named
    assert "| rl | 0.9 | — | yes | 10 |" in text  # the served variant is marked in the stage table
    html = R.markdown_to_html(text, figures)
    assert html.count("data:image/png;base64,") == 4 and "](plots/" not in html and "<table>" in html


def test_operating_point_candidates_are_listed_with_their_timed_speeds() -> None:
    def candidate(tau: float, window: int | None, at1: float, at16: float) -> dict:
        return {"tau": tau, "window": window, "recall@1": 0.15, "unforced_rate": 0.6, "tokens_per_forward": 3.0,
                "tokens_per_s_by_batch": {"1": at1, "16": at16}, "tokens_per_s": (at1 * at16) ** 0.5}  # fmt: skip

    candidates = [candidate(0.9, None, 1000.0, 4000.0), candidate(0.6, 4, 1600.0, 4900.0)]
    candidates[1] |= {"speedup_vs_ar_rl": 1.25, "speedup_vs_ar_rl_low": 1.1, "speedup_vs_ar_rl_high": 1.4}
    candidates[1]["statistic"] = "median of 3 interleaved rounds"
    paired = {"": 0.012, ".low": -0.01, ".high": 0.034, ".half_width": 0.022, ".n": 1267}
    candidates[1] |= {f"recall@1_vs_ar_rl{k}": v for k, v in paired.items()}
    point = {"tau": 0.6, "window": 4, "budget": 0.01, "chosen": candidates[1], "candidates": candidates}
    text = R.render_markdown(_inputs(operating_point={"rl": point}), {})
    assert (
        "| system | tau | window | R@1 | R@1 - ar_rl [interval] (n) | own valid | tokens/forward | tokens/s @1 |"
        in text
    )
    assert "| rl | 0.9 | — | 0.1500 | — | 0.6000 | 3.000 | 1000.0 | 4000.0 | 2000.0 | — |  |" in text
    assert (
        "| rl | 0.6 | 4 | 0.1500 | +0.0120 [-0.010, +0.034] (1267) | 0.6000 | 3.000 | 1600.0 | 4900.0 | 2800.0 "
        "| 1.2500 [1.100, 1.400] | yes |" in text
    )
    assert "geometric mean" in text and "(median of 3 interleaved rounds)" in text
    # A candidate the accuracy gates refused is not timed: its pass's tokens/s is not shown as ranked.
    untimed = {k: v for k, v in candidate(0.4, None, 0.0, 0.0).items() if k != "tokens_per_s_by_batch"}
    point["candidates"] = [*candidates, untimed | {"tokens_per_s": 123.0}]
    text = R.render_markdown(_inputs(operating_point={"rl": point}), {})
    assert "| rl | 0.4 | — | 0.1500 | — | 0.6000 | 3.000 | — | — | — | — |  |" in text
    assert "is not timed (—)" in text


def test_the_forward_cost_table_is_relative_to_an_ar_step_with_intervals() -> None:
    def ratio(value: float) -> dict:
        return {"ratio": value, "ratio_low": value - 0.1, "ratio_high": value + 0.1}

    setting = {"system": "rl", "tau": 0.9, "window": 0, "batch": 1, "tokens_per_forward": 3.0,
               "ms_per_forward_call": 1.0, "wall_s": 2.0, "forward_s": 1.0, "grammar_s": 0.5, "other_s": 0.5,
               "tokens_per_s": 900.0, "speedup_vs_ar": 1.5, "speedup_vs_ar_low": 1.4, "speedup_vs_ar_high": 1.6}  # fmt: skip
    profile = {
        "statistic": "median of 3 interleaved rounds",
        "step_statistic": "median of 15 interleaved rounds",
        "settings": [setting],
        "step_costs": {"rl@1/lean": {"ms": {}, "cost": {"ar_step": ratio(1.0), "canvas_8": ratio(1.3)},
                                     "logit_rows": {"ar_step": 1, "canvas_8": 7}}},
    }  # fmt: skip
    text = R.render_markdown(_inputs(decode_profile=profile), {})
    assert (
        "| rl | 0.9 | — | 1 | 3.000 | 1.000 | 0.500 | 0.250 | 0.250 | 900.0 | 1.5000 [1.400, 1.600] |" in text
    )
    assert "| setting | ar_step (1 rows) | canvas_8 (7 rows) |" in text
    assert "| rl@1/lean | 1.0000 [0.900, 1.100] | 1.3000 [1.200, 1.400] |" in text
    assert "Tokens/s: median of 3 interleaved rounds." in text and "median of 15 interleaved rounds" in text
    old = R.render_markdown(_inputs(decode_profile={"settings": [], "canvas_ms": {"rl@1/lean": {}}}), {})
    assert "predates the step-cost fix" in old


def _sources(run_id: str | None) -> RunSources:
    """Report files whose stage table a run `run_id` wrote (None: outside MLflow)."""
    return RunSources({"stage_metrics.json": STAGES}, {"stage_metrics.json": RunManifest(run_id=run_id)})


def test_training_curves_come_from_the_report_run_not_a_newer_one(tmp_path: Path) -> None:
    mlflow.set_tracking_uri(empty_mlflow_store(tmp_path / "mlflow.db"))
    try:
        experiment = mlflow.create_experiment("curves", artifact_location=str(tmp_path / "artifacts"))
        with mlflow.start_run(experiment_id=experiment) as reported:  # trains cft and rl, evaluates
            for step, loss in enumerate((3.0, 2.0, 1.5)):
                mlflow.log_metric("cft.loss", loss, step=step)
            mlflow.log_metrics({"rl.loss": 0.7, "rl.reward_mean": 0.25}, step=2)
        with mlflow.start_run(experiment_id=experiment) as newer:  # a later run retrains rl, trains opd
            mlflow.log_metrics({"rl.loss": 0.1, "rl.reward_mean": -0.5}, step=4)
            mlflow.log_metric("opd.loss", 0.3, step=1)
        # the benchmark re-renders the report in its own run: the stage table's run still decides
        run = R.report_run(_sources(reported.info.run_id), writing_run=newer.info.run_id)
        curves = R.load_training_curves(run, ["cft", "rl", "opd"])
        assert R.load_training_curves("0" * 32, ["cft"]) == {}  # a run the store does not hold
    finally:
        mlflow.set_tracking_uri("")
    assert run == reported.info.run_id
    assert curves == {
        "cft": {"loss": [(0, 3.0), (1, 2.0), (2, 1.5)]},
        "rl": {"loss": [(2, 0.7)], "reward_mean": [(2, 0.25)]},
    }  # rl as the reported run trained it, not the newer run's; opd only in the newer run: absent
    assert R.load_training_curves(None, ["cft"]) == {}

    inputs = _inputs(
        training_curves=curves,
        training_stages=("cft", "opd", "rl"),
        runs=_sources(reported.info.run_id),
        writing_run=newer.info.run_id,
    )
    assert R.missing_curves(inputs) == ["opd"]
    text = R.render_markdown(inputs, R.report_figures(inputs))
    assert f"metric history of run {run[:8]}, the run the stage table comes from" in text
    assert f"**Not in run {run[:8]}**: `opd` (trained in another run, or not trained" in text


def test_the_report_run_is_the_stage_tables_else_the_writing_run() -> None:
    assert R.report_run(_sources("a" * 32), "b" * 32) == "a" * 32
    assert R.report_run(None, "b" * 32) == "b" * 32  # no manifests read: the run writing the report
    assert R.report_run(RunSources({"stage_metrics.json": STAGES}, {}), "b" * 32) == "b" * 32
    assert R.report_run(_sources(None), "b" * 32) is None  # stage table written outside MLflow
    none = _inputs(runs=_sources(None), training_stages=("cft",))
    assert "come from no MLflow run" in R.render_markdown(none, R.report_figures(none))
    empty = _inputs(runs=_sources("c" * 32), training_stages=("cft",))
    assert "No history was found in run cccccccc" in R.render_markdown(empty, R.report_figures(empty))


def test_a_metric_older_stage_rows_lack_prints_a_dash() -> None:
    row = {"recall@1": 0.25, "ci": {"recall@1": (0.2, 0.3)}}  # written before prerank_copy_rate existed
    assert R._cell(row, "prerank_copy_rate") == "—"
    assert R._cell(row, "recall@1") == "0.2500 [0.200, 0.300]"
