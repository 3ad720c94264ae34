"""End-to-end: the whole default DAG (data_prep → evaluation) through a Kedro session, smoke sizes."""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import torch

from diffusion_gr2.core.base.manifest import read_report
from diffusion_gr2.core.bench.benchmark import BENCHMARK_KEYS
from diffusion_gr2.core.evaluate.rankings import stage_metrics
from tests.conftest import PROJECT_ROOT, run_kedro

SYSTEMS = ("prerank", "analyst", "ar_sft", "ar_rl", "naive", "cft", "opd", "rl", "distilled")


def report(project: Path, name: str):
    """A report file's figures (the evaluation's carry their run's manifest: `read_report` drops it)."""
    return read_report(project / "data/08_reporting" / name)[0]


def test_reports_have_the_documented_keys(dag_run: Path) -> None:
    sid = report(dag_run, "sid_report.json")
    assert {
        "levels",
        "codebook_sizes",
        "uniqueness_3",
        "uniqueness_4",
        "collisions_3",
        "embedding_model",
    } <= set(sid)
    assert sid["uniqueness_4"] == 1.0
    retrieval = report(dag_run, "retrieval_report.json")
    assert {"recall@10", "ndcg@10"} <= set(retrieval["retriever"]) & set(retrieval["popularity"])
    assert retrieval["candidate_mode"] == "retrieved" and set(retrieval["users_kept"]) == {
        "train",
        "valid",
        "test",
    }
    traces = report(dag_run, "trace_report.json")
    assert 0 < traces["acceptance_rate"] <= 1 and traces["mean_answer_tokens"] > 0


def test_stage_metrics_cover_every_system_and_are_recomputable(dag_run: Path) -> None:
    rows = report(dag_run, "stage_metrics.json")
    assert {r["system"] for r in rows} == set(SYSTEMS)
    for row in rows:
        assert {"tau", "n", "recall@1", "ndcg@3", "mrr", "valid_rate", "fallback_rate", "ci"} <= set(row)
        assert (row["tau"] is None) == (row["system"] in ("prerank", "analyst", "ar_sft", "ar_rl"))
    rankings = pd.read_parquet(dag_run / "data/07_model_output/rankings.parquet")
    assert {r["split"] for r in rows} == {"valid", "test"}  # choose on valid, report on test
    recomputed = json.loads(json.dumps(stage_metrics(rankings, n_boot=10)))
    without_ci = [{k: v for k, v in row.items() if k != "ci"} for row in rows]
    assert [{k: v for k, v in row.items() if k != "ci"} for row in recomputed] == without_ci


def test_the_analysts_row_is_the_trace_reports_ceiling_on_the_same_requests(dag_run: Path) -> None:
    """The stage table's `analyst` R@1 is the learned analyst's noiseless top hit rate (`top_hits`, which
    `trace_report.json` reports) on the requests the row answered; equal to the report's own figure
    where inference answered every request of the split."""
    from diffusion_gr2.core.text.evidence import evidence_from_spec
    from diffusion_gr2.core.text.learned_analyst import LearnedAnalyst, top_hits
    from diffusion_gr2.core.text.prompt import ItemLookup, PromptConfig
    from diffusion_gr2.core.text.traces import examples_from_frame

    data = dag_run / "data"
    items, splits = (
        pd.read_parquet(data / p) for p in ("03_primary/items.parquet", "05_model_input/splits.parquet")
    )
    candidates = pd.read_parquet(data / "05_model_input/candidates.parquet")
    evidence = evidence_from_spec(
        json.loads((data / "05_model_input/evidence.json").read_text()), splits, items
    )
    lookup = ItemLookup.from_frames(items, pd.read_parquet(data / "04_feature/sids.parquet"), PromptConfig())
    analyst = LearnedAnalyst(evidence, lookup)
    rankings = pd.read_parquet(data / "07_model_output/rankings.parquet")
    ceiling = report(dag_run, "trace_report.json")["analyst"]
    for row in (r for r in report(dag_run, "stage_metrics.json") if r["system"] == "analyst"):
        split = row["split"]
        rows = rankings[(rankings["system"] == "analyst") & (rankings["split"] == split)]
        assert rows["valid"].all() and (rows["nfe"] == 0).all() and (rows["output_tokens"] == 0).all()
        asked = candidates.merge(rows[["split", "user_id", "point"]], on=["split", "user_id", "point"])
        hits = top_hits(analyst, examples_from_frame(asked))
        assert len(hits) == row["n"] and row["recall@1"] == pytest.approx(float(hits.mean()))
        if row["n"] == ceiling[split]["n"]:
            assert row["recall@1"] == pytest.approx(ceiling[split]["analyst_recall@1"])


def test_every_model_is_saved_with_its_tokenizer_and_logged(dag_run: Path) -> None:
    for name in ("ar_sft", "ar_rl", "naive", "cft", "opd", "rl", "distilled"):
        folder = dag_run / "data/06_models" / name
        assert (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists()
    config = json.loads((dag_run / "data/06_models/naive/config.json").read_text())
    assert config["block_size"] > 1 and config["mask_token_id"] is not None
    mlflow.set_tracking_uri(f"sqlite:///{dag_run / 'mlflow.db'}")
    runs = mlflow.search_runs(
        experiment_names=["diffusion-gr2"],
        filter_string="tags.pipeline = '__default__'",
        output_format="list",
    )
    assert runs, "no MLflow run for the default pipeline"
    client = mlflow.MlflowClient()
    logged = {a.path for a in client.list_artifacts(runs[0].info.run_id, "models")}
    assert {"models/ar_rl", "models/rl", "models/distilled", "models/tokenizer"} <= logged
    metrics = client.get_metric_history(runs[0].info.run_id, "ar_sft.loss")
    assert len(metrics) >= 1
    # where the run's time went: every node timed, on the run and in node_times.json
    times = report(dag_run, "node_times.json")
    logged_times = {k for k in runs[0].data.metrics if k.startswith("timing.")}
    assert {"timing.train_cft_s", "timing.train_diffusion_rl_s", "timing.train_distilled_s"} <= logged_times
    assert times["nodes_s"] and 0 < sum(times["nodes_s"].values()) <= times["total_s"]  # the last run's


def test_training_resumes_from_its_checkpoint(dag_run: Path) -> None:
    """A second run with the same inputs and parameters picks up the finished checkpoint."""
    run_kedro(dag_run, ["cft"])
    summary = report(dag_run, "training/cft.json")
    assert summary["resumed_from_step"] == summary["steps"] > 0


def run_script(project: Path, script: str, *args: str) -> str:
    """Run one of `benchmarks/` on the smoke project's outputs, as a user would; its stdout.

    The script runs as `__main__` with its command line in `sys.argv` and the project as working
    directory, in this process: a new interpreter would spend ~8 s importing torch, transformers and
    Kedro again, for each of the seven scripts run here. The thread count it sets is put back.
    """
    path, out, threads = PROJECT_ROOT / "benchmarks" / script, io.StringIO(), torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.chdir(project)
        patch.setattr(sys, "argv", [str(path), *args])
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as stop:
            assert stop.code in (None, 0), f"{script} exited with {stop.code}:\n{out.getvalue()[-2000:]}"
        finally:
            torch.set_num_threads(threads)
    return out.getvalue()


def test_saved_model_benchmark_script_times_the_trained_models(dag_run: Path, tmp_path: Path) -> None:
    data, conf = dag_run / "data", dag_run / "conf/smoke"
    points = tmp_path / "operating_point.json"  # cft at a known point, whatever validation chose
    points.write_text(json.dumps({"cft": {"tau": 0.9, "window": 2, "refused": None}}))
    run_script(
        dag_run,
        "saved_models_bench.py",
        *("--models", str(data / "06_models"), "--requests", str(data / "05_model_input/requests.parquet")),
        *("--params", str(conf / "parameters_benchmark.yml"), "--systems", "ar_rl", "cft"),
        *("--operating-point", str(points), "--rounds", "1", "--min-calls", "1", "--threads", "1"),
        *("--out", str(tmp_path)),
    )
    rows = json.loads((tmp_path / "benchmark.json").read_text())
    assert [(r["system"], r["window"], r["constrained"], r["batch_size"]) for r in rows] == [
        (s, w, c, b)
        for s, w in (("ar_rl", None), ("generate", None), ("cft", 2))
        for c in (True, False)
        for b in (1, 4)
    ]  # smoke: batch 1 and 4; rl (the sweep) not asked for
    assert all(list(r) == list(BENCHMARK_KEYS) and r["output_tokens_per_s"] > 0 for r in rows)


def test_cft_scaling_script_trains_and_reports_each_step_count(dag_run: Path, tmp_path: Path) -> None:
    data = dag_run / "data"
    run_script(
        dag_run,
        "cft_scaling.py",
        *("--steps", "1", "2", "--taus", "0.9", "--max-users", "2", "--models", str(data / "06_models")),
        *(
            "--data",
            str(data / "05_model_input"),
            "--params",
            str(dag_run / "conf/smoke/parameters_training.yml"),
        ),
        *("--save", str(tmp_path / "models"), "--out", str(tmp_path / "scaling.json")),
    )
    rows = json.loads((tmp_path / "scaling.json").read_text())
    assert [(r["cft_steps"], r["tau"], r["n"]) for r in rows] == [(1, 0.9, 2), (2, 0.9, 2)]
    assert all(0.0 <= r["unforced_rate"] <= 1.0 and r["tokens_per_forward"] >= 1.0 for r in rows)
    assert (tmp_path / "models/cft2/config.json").is_file()


def test_feature_ceiling_script_reports_every_split(dag_run: Path) -> None:
    out = run_script(
        dag_run,
        "feature_ceiling.py",
        *(
            "--c",
            "1",
            "--data",
            str(dag_run / "data"),
            "--params",
            str(dag_run / "conf/smoke/parameters_traces.yml"),
            "--w-position",
            "0.5",
            "2.5",
        ),
    )
    lines = out.splitlines()
    headers = [i for i, line in enumerate(lines) if line.split()[1] == "split"]
    teacher, ranker = lines[headers[0] + 1 : headers[1]], lines[headers[1] + 1 :]
    assert len(headers) == 2 and len(teacher) == 6  # the noiseless teacher per weight, then the ranker
    assert (
        {line.split()[1] for line in teacher}
        == {line.split()[1] for line in ranker}
        == {"train", "valid", "test"}
    )
    assert all(v == "nan" or 0.0 <= float(v) <= 1.0 for line in teacher for v in line.split()[2:])


def test_decode_profile_and_variants_scripts_run_on_the_trained_models(dag_run: Path, tmp_path: Path) -> None:
    data = dag_run / "data"
    inputs = (
        "--models",
        str(data / "06_models"),
        "--requests",
        str(data / "05_model_input/requests.parquet"),
    )
    out = run_script(
        dag_run,
        "decode_profile.py",
        *inputs,
        *("--systems", "ar_rl", "rl", "--n", "2", "--batch-sizes", "1", "2", "--threads", "1"),
        *("--repeats", "1", "--windows", "0", "2", "--backends", "lean", "eager", "--sid-tau", "0.99"),
        *("--json", str(tmp_path / "profile.json")),
    )
    profile = json.loads((tmp_path / "profile.json").read_text())
    # ar_rl at 2 batch sizes, rl at 2 windows x 2 batch sizes, each with both forwards
    assert len(profile["settings"]) == (2 + 2 * 2) * 2
    for row in profile["settings"]:
        assert row["forward_s"] > 0 and row["forward_s"] + row["grammar_s"] <= row["wall_s"]
    by_backend = {
        b: [r["tokens"] for r in profile["settings"] if r["backend"] == b] for b in ("lean", "eager")
    }
    assert by_backend["lean"] == by_backend["eager"]  # the same tokens from either forward
    assert set(profile["step_costs"]) == {f"rl@{b}/{f}" for b in (1, 2) for f in ("lean", "eager")}
    for costs in profile["step_costs"].values():  # every step kind reads LM-head rows, relative to AR
        assert costs["cost"]["ar_step"]["ratio"] == 1.0 and min(costs["logit_rows"].values()) >= 1
    assert "forward cost" in out and profile["statistic"].startswith("median of 3 interleaved rounds")
    for row in profile["settings"]:  # diffusion rows split their tokens by part of the answer
        regions = row["regions"]
        assert (row["system"] == "rl") == bool(regions)
        assert sum(c["tokens"] for c in regions.values()) == (row["tokens"] if regions else 0)
    run_script(
        dag_run,
        "operating_point_timing.py",
        *inputs,
        *("--params", str(dag_run / "conf/smoke/parameters_inference.yml"), "--repeats", "2"),
        *("--threads", "1", "--json", str(tmp_path / "timing.json")),
    )
    repeats = json.loads((tmp_path / "timing.json").read_text())
    assert len(repeats) == 2 and all(len(r["candidates"]) == 2 for r in repeats)  # smoke: tau 0.9 x 2 windows
    assert all(set(c["tokens_per_s_by_batch"]) == {"1", "4"} for r in repeats for c in r["candidates"])
    run_script(
        dag_run,
        "decode_variants.py",
        *inputs,
        *("--taus", "0.9", "--max-users", "2", "--threads", "1", "--json", str(tmp_path / "variants.json")),
        *("--systems", "ar_rl", "rl", "--copy", "off", "on", "--cite", "off", "on", "--reference", "ar_rl"),
        *("--sid-taus", "0.99", "--sid-scopes", "answer", "list"),
    )
    variants = json.loads((tmp_path / "variants.json").read_text())
    got = [
        (v["system"], v["mode"], v["copy_drafts"], v["cite_prompt_sids"], v["sid_scope"], v["n"])
        for v in variants
    ]
    # AR: no modes, taus, copy drafts or SID tau
    ar = [("ar_rl", "fused", False, cite, "answer", 2) for cite in (False, True)]
    rl = [
        ("rl", m, c, cite, scope, 2)
        for m in ("fused", "separate")
        for c in (False, True)
        for cite in (False, True)
        for scope in ("answer", "list")
    ]
    assert got == ar + rl
    assert {v["sid_threshold"] for v in variants} == {None, 0.99}
    assert all(0.0 <= v["unforced_rate"] <= 1.0 and v["tokens_per_forward"] >= 1.0 for v in variants)
    assert all(v["recall@1_vs_reference"] is not None for v in variants)
    assert variants[0]["recall@1_vs_reference"] == [0.0, 0.0, 0.0]  # ar_rl against itself
    out = run_script(
        dag_run,
        "draft_length.py",
        *inputs,
        *("--prompts", "2", "--rounds", "1", "--lookup", "2", "--model-drafts", "4", "--threads", "1"),
    )
    assert "ar_rl+pld 2" in out and "ar_rl+rl-draft 4" in out  # each asserted lossless on every prompt
