"""Every report file carries the run it came from, and the one loader labels or refuses a mixture.

Files are written here the way a run writes them (`RunReportDataset` under the run context the hook
opens), by two runs: a whole run, then a partial rerun (`--pipelines inference,evaluation`) that
rewrites three of the four files `make results` reads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from diffusion_gr2.core.base import manifest
from diffusion_gr2.core.base.manifest import MixedRunsError, RunManifest, load_reports, read_report
from diffusion_gr2.core.evaluate.results import results_markdown, runs_text
from diffusion_gr2.datasets import AtomicJSONDataset, OptionalJSONDataset, ReportRunsDataset, RunReportDataset
from tests.core.evaluate.test_results import bench, paired, stage

MACHINE = {"cpu_cores": 2, "torch_threads": 2, "gpu": None}
RUN_A = RunManifest(
    run_id="aaaaaaaa11112222",
    git_commit="c0ffee0123456789",
    env="local",
    pipelines=("__default__",),
    started="2026-12-01T10:00:00+00:00",
    machine=MACHINE,
)
RUN_B = RunManifest(
    run_id="bbbbbbbb33334444",
    git_commit="deadbee987654321",
    git_dirty=True,
    env="local",
    pipelines=("inference", "evaluation"),
    started="2026-12-02T09:00:00+00:00",
    machine=MACHINE,
)
ACCURACY = ("stage_metrics", "comparisons", "operating_point")


@pytest.fixture(autouse=True)
def _no_open_run():
    manifest.end_run()
    yield
    manifest.end_run()


def _figures(r1: float) -> dict[str, object]:
    return {
        "stage_metrics": [
            stage("prerank", None, None, 0.19, 1.0),
            stage("ar_rl", None, None, 0.18, 0.52),
            stage("rl", 0.6, None, r1, 0.53),
        ],
        "comparisons": [paired("ar_rl", None, "prerank", -0.01), paired("rl", 0.6, "ar_rl", r1 - 0.18)],
        "operating_point": {"rl": {"tau": 0.6, "window": None}},
        "benchmark": [
            bench("ar_rl", None, 1, [100.0, 100.0, 100.0], 1.0),
            bench("rl", 0.6, 1, [200.0, 200.0, 200.0], 2.0),
        ],
    }


def _write_run(folder: Path, run: RunManifest, names: tuple[str, ...], r1: float, models: dict) -> None:
    """What a run's nodes save, through the dataset the catalog names, under the hook's run context."""
    manifest.begin_run(run)
    manifest.note_models(models, "some_node")
    figures = _figures(r1)
    for name in names:
        RunReportDataset(str(folder / f"{name}.json")).save(figures[name])
    manifest.end_run()
    timing = {"total_s": 600.0 if run is RUN_A else 120.0, "nodes_s": {}, "run": {"run_id": run.run_id}}
    suffix = "" if run.pipelines == ("__default__",) else "." + "+".join(run.pipelines)
    (folder / f"node_times{suffix}.json").write_text(json.dumps(timing))


def test_a_report_carries_its_run_and_loads_as_its_data(tmp_path: Path) -> None:
    path = tmp_path / "stage_metrics.json"
    manifest.begin_run(RUN_A)
    manifest.note_models({"model_rl": "abc.dir", "model_tokenizer": None}, "compute_stage_metrics")
    RunReportDataset(str(path)).save([{"system": "rl"}])
    stored = json.loads(path.read_text())
    assert stored["data"] == [{"system": "rl"}]
    assert (
        stored["manifest"]["run_id"] == RUN_A.run_id and stored["manifest"]["git_commit"] == RUN_A.git_commit
    )
    assert stored["manifest"]["models"] == {"model_rl": "abc.dir"}  # what was loaded, with its digest
    assert stored["manifest"]["node"] == "compute_stage_metrics"
    assert stored["manifest"]["pipelines"] == ["__default__"] and stored["manifest"]["env"] == "local"
    # nodes (and every reader through the catalog) see the data only
    for dataset in (RunReportDataset, AtomicJSONDataset, OptionalJSONDataset):
        assert dataset(str(path)).load() == [{"system": "rl"}]
    data, read = read_report(path)
    assert data == [{"system": "rl"}] and read == manifest.current_manifest()


def test_a_file_written_outside_a_run_says_so_and_an_old_file_loads_unlabelled(tmp_path: Path) -> None:
    RunReportDataset(str(tmp_path / "a.json")).save({"x": 1})
    data, read = read_report(tmp_path / "a.json")
    assert data == {"x": 1} and read is not None and read.run_id is None and read.env == "none"
    (tmp_path / "b.json").write_text(json.dumps({"manifest": 1, "data": 2}))  # not a stamp
    assert read_report(tmp_path / "b.json") == ({"manifest": 1, "data": 2}, None)


def test_one_run_gives_one_run_line(tmp_path: Path) -> None:
    _write_run(tmp_path, RUN_A, (*ACCURACY, "benchmark"), 0.20, {"model_rl": "r1.dir"})
    table = results_markdown(tmp_path)
    line = table.rstrip().splitlines()[-1]
    assert line == (
        "Run: stage_metrics.json, comparisons.json, operating_point.json, benchmark.json: run aaaaaaaa "
        "(2026-12-01T10:00:00+00:00, commit c0ffee0, env local, pipelines __default__); 2 CPU cores, "
        "2 torch threads, no GPU; 10.0 min."
    )
    assert results_markdown(tmp_path, strict=True) == table


def test_after_a_partial_rerun_each_figure_is_shown_with_the_run_it_came_from(tmp_path: Path) -> None:
    _write_run(tmp_path, RUN_A, (*ACCURACY, "benchmark"), 0.20, {"model_rl": "r1.dir"})
    _write_run(tmp_path, RUN_B, ACCURACY, 0.30, {"model_rl": "r1.dir"})  # same weights, new decoding
    table = results_markdown(tmp_path)
    assert "| rl | tau 0.6, whole block | 100 | 0.300 [0.250, 0.350]" in table  # run B's figures
    assert "Runs (the figures come from 2 runs):" in table
    assert (
        "* stage_metrics.json, comparisons.json, operating_point.json: run bbbbbbbb "
        "(2026-12-02T09:00:00+00:00, commit deadbee (uncommitted changes), env local, pipelines inference, "
        "evaluation); 2 CPU cores, 2 torch threads, no GPU; 2.0 min." in table
    )
    assert (
        "* benchmark.json: run aaaaaaaa (2026-12-01T10:00:00+00:00, commit c0ffee0, env local, pipelines "
        "__default__); 2 CPU cores, 2 torch threads, no GPU; 10.0 min." in table
    )
    assert "Mixed models" not in table  # the benchmark timed the weights the new figures measured
    with pytest.raises(MixedRunsError, match="from several runs"):
        results_markdown(tmp_path, strict=True)


def test_figures_of_other_weights_are_flagged_and_refused_when_strict(tmp_path: Path) -> None:
    _write_run(
        tmp_path, RUN_A, (*ACCURACY, "benchmark"), 0.20, {"model_rl": "old.dir", "model_ar_rl": "t.dir"}
    )
    _write_run(
        tmp_path, RUN_B, ACCURACY, 0.30, {"model_rl": "new.dir", "model_ar_rl": "t.dir"}
    )  # retrained rl
    table = results_markdown(tmp_path)
    assert (
        "**Mixed models**: these files measured different weights: model_rl: stage_metrics.json new.dir vs "
        "benchmark.json old.dir." in table
    )
    with pytest.raises(MixedRunsError, match="measuring different weights: model_rl"):
        results_markdown(tmp_path, strict=True)


def test_a_failed_rerun_leaves_its_files_labelled_with_no_timing_record(tmp_path: Path) -> None:
    _write_run(tmp_path, RUN_A, (*ACCURACY, "benchmark"), 0.20, {})
    manifest.begin_run(RUN_B)  # wrote stage_metrics.json, then failed: no node_times record
    RunReportDataset(str(tmp_path / "stage_metrics.json")).save(_figures(0.3)["stage_metrics"])
    manifest.end_run()
    table = results_markdown(tmp_path)
    assert (
        "* stage_metrics.json: run bbbbbbbb" in table
        and "no node_times record (running when this was written, or failed)" in table
    )
    assert "* comparisons.json, operating_point.json, benchmark.json: run aaaaaaaa" in table


def test_the_report_of_a_run_still_running_says_so_not_that_it_failed(tmp_path: Path) -> None:
    """The report is its run's last node: the run's minutes are recorded only after it."""
    manifest.begin_run(RUN_B)
    for name, data in _figures(0.3).items():
        if name in ACCURACY:
            RunReportDataset(str(tmp_path / f"{name}.json")).save(data)
    manifest.end_run()
    sources = load_reports(tmp_path, [f"{n}.json" for n in ACCURACY])
    assert "this run, still running when this was written" in runs_text(sources, RUN_B.run_id)
    assert "no node_times record (running when this was written, or failed)" in runs_text(sources, "other")


def test_files_without_a_run_record_are_labelled(tmp_path: Path) -> None:
    _write_run(tmp_path, RUN_A, ("stage_metrics", "comparisons", "benchmark"), 0.20, {})
    (tmp_path / "operating_point.json").write_text(json.dumps(_figures(0.2)["operating_point"]))  # by hand
    table = results_markdown(tmp_path)
    assert "* operating_point.json: no run record (written before run manifests, or by hand)." in table
    with pytest.raises(MixedRunsError, match="with no run record: operating_point.json"):
        results_markdown(tmp_path, strict=True)


def test_the_command_refuses_a_mixture_when_strict(tmp_path: Path) -> None:
    _write_run(tmp_path, RUN_A, (*ACCURACY, "benchmark"), 0.20, {})
    _write_run(tmp_path, RUN_B, ACCURACY, 0.30, {})
    command = [sys.executable, "-m", "diffusion_gr2", "results", "--reporting", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "Runs (the figures come from 2 runs)" in done.stdout
    done = subprocess.run([*command, "--strict"], capture_output=True, text=True, check=False)
    assert done.returncode == 1 and done.stderr.startswith("report files from several runs")
    assert "Traceback" not in done.stderr


def test_the_report_lists_the_runs_its_figures_came_from(tmp_path: Path) -> None:
    from diffusion_gr2.core.evaluate.report import ReportInputs, render_markdown

    _write_run(tmp_path, RUN_A, (*ACCURACY, "benchmark"), 0.20, {})
    _write_run(tmp_path, RUN_B, ACCURACY, 0.30, {})
    runs = ReportRunsDataset(str(tmp_path)).load()
    assert runs == load_reports(tmp_path, manifest.RUN_REPORTS)
    figures = _figures(0.3)
    inputs = ReportInputs(
        figures["stage_metrics"], figures["comparisons"], [], [], figures["operating_point"], runs=runs
    )
    report = render_markdown(inputs, {})
    results = report[report.index("## Results") : report.index("## Data")]
    assert "Runs (the figures come from 2 runs):" in results
    assert "* stage_metrics.json, comparisons.json, operating_point.json: run bbbbbbbb" in results
    assert "* benchmark.json: run aaaaaaaa" in results


def test_the_hook_opens_the_run_and_notes_the_models_each_node_loads(tmp_path: Path, monkeypatch) -> None:
    from diffusion_gr2 import hooks

    monkeypatch.setattr(hooks, "git_commit", lambda _p: {"git_commit": "f00d", "git_dirty": "false"})
    monkeypatch.setattr(hooks, "machine", lambda: MACHINE)
    monkeypatch.setattr(
        hooks.mlflow, "active_run", lambda: SimpleNamespace(info=SimpleNamespace(run_id="r-1"))
    )
    model = tmp_path / "rl"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    catalog = {
        "model_rl": SimpleNamespace(_filepath=model),
        "requests": SimpleNamespace(_filepath=tmp_path / "x"),
    }
    hook = hooks.RunManifestHooks()
    hook.before_pipeline_run({"project_path": str(tmp_path), "pipeline_names": ["benchmark"], "env": "smoke"})
    node = SimpleNamespace(name="benchmark_decoding", inputs=["model_rl", "requests", "params:benchmark"])
    hook.before_node_run(node, SimpleNamespace(get=catalog.get))
    run = manifest.current_manifest()
    assert (run.run_id, run.git_commit, run.env, run.pipelines) == ("r-1", "f00d", "smoke", ("benchmark",))
    assert run.node == "benchmark_decoding" and list(run.models) == ["model_rl"]
    assert run.models["model_rl"].endswith(".dir") and run.machine == MACHINE and not run.partial
    hook.after_pipeline_run()
    assert manifest.current_manifest().run_id is None  # closed: a later write is not this run's
    hook.before_pipeline_run({"project_path": str(tmp_path), "node_names": ["a"]})
    assert manifest.current_manifest().partial and manifest.current_manifest().pipelines == ("__default__",)
    hook.on_pipeline_error()
    assert manifest.current_manifest().run_id is None
