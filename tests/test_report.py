"""End-to-end: the run report and the notebooks, on the smoke DAG's outputs (`dag_run`).

The report's numbers are parsed back from `report.md`'s tables and compared with the JSON files they
come from, at the precision the report prints (4 decimals, intervals 3).
"""

from __future__ import annotations

import re
from pathlib import Path

import mlflow
import nbformat
import pytest
import torch
from nbclient import NotebookClient

from diffusion_gr2.core.base.manifest import read_report
from diffusion_gr2.core.evaluate.metrics import REASONING_METRICS
from diffusion_gr2.core.evaluate.report import BENCHMARK_COLUMNS, STAGE_COLUMNS
from tests.conftest import PROJECT_ROOT, run_kedro

NOTEBOOKS = sorted((PROJECT_ROOT / "notebooks").glob("*.ipynb"))
SECTIONS = (
    "## Data, semantic IDs and retriever",
    "## Stage table (test)",
    "### Served operating points",
    "## Paired differences (test",
    "## Reasoning quality (test",
    "## Decode benchmark",
    "## Plots",
)
_NUMBER = re.compile(r"[-+]?\d+\.\d+")


def _table(markdown: str, heading: str) -> list[list[str]]:
    """Body rows (cells stripped) of the first table after the line starting with `heading`."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rows, seen = [], False
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            seen = True
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif seen or line.startswith("#"):
            break
    return rows[2:]  # header and separator


def _cell(text: str) -> list[float]:
    """`0.1854 [0.119, 0.252]` -> [0.1854, 0.119, 0.252]."""
    return [float(x) for x in _NUMBER.findall(text)]


def _variant(cells: list[str]) -> tuple[str, float | None, int | None]:
    return cells[0], None if cells[1] == "—" else float(cells[1]), None if cells[2] == "—" else int(cells[2])


def _assert_cell(text: str, value: float, ci: list[float]) -> None:
    got = _cell(text)
    assert got[0] == pytest.approx(value, abs=5.01e-5), text  # half the last printed digit
    assert got[1:] == pytest.approx(ci, abs=5.01e-4), text


def _read(project: Path, name: str) -> str:
    return (project / "data/08_reporting" / name).read_text()


def _data(project: Path, name: str):
    """A report file's figures (without the run manifest it carries)."""
    return read_report(project / "data/08_reporting" / name)[0]


@pytest.fixture(scope="module")
def reports(dag_run: Path) -> dict[str, str]:
    """report.md after the default run, then after `benchmark` on the same outputs."""
    before = _read(dag_run, "report.md")
    threads = torch.get_num_threads()  # the benchmark sets the process's thread count
    try:
        run_kedro(dag_run, ["benchmark"])
    finally:
        torch.set_num_threads(threads)
    return {"before": before, "after": _read(dag_run, "report.md")}


@pytest.mark.slow
def test_the_default_run_writes_every_section_and_names_the_missing_benchmark(
    dag_run: Path, reports: dict[str, str]
) -> None:
    before = reports["before"]
    assert all(heading in before for heading in SECTIONS)
    assert "`benchmark.json` is absent from this run: `make benchmark` writes it." in before
    assert "absent" not in before.split("## Decode benchmark")[0]  # data, SID and retriever files exist
    for name in ("frontier", "own_valid_rate", "training_curves"):
        assert f"](plots/{name}.png)" in before
        assert (dag_run / f"data/08_reporting/plots/{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert "No history was found" not in before  # the training curves came from MLflow
    html = _read(dag_run, "report.html")
    assert html.count("data:image/png;base64,") >= 3 and "<table>" in html


@pytest.mark.slow
def test_report_numbers_equal_stage_metrics_comparisons_and_reasoning(dag_run: Path, reports: dict) -> None:
    report = reports["after"]
    test_rows = [r for r in _data(dag_run, "stage_metrics.json") if r["split"] == "test"]
    table = _table(report, "## Stage table (test)")
    assert [_variant(c) for c in table] == [(r["system"], r["tau"], r["window"]) for r in test_rows]
    for cells, row in zip(table, test_rows, strict=True):
        assert int(cells[4]) == row["n"]
        for (metric, _), text in zip(STAGE_COLUMNS, cells[5 : 5 + len(STAGE_COLUMNS)], strict=True):
            _assert_cell(text, row[metric], row["ci"][metric])
    served = {(s, p["tau"], p["window"]) for s, p in _data(dag_run, "operating_point.json").items()}
    assert {_variant(c) for c in table if c[3] == "yes"} == {v for v in served if v[1] is not None}

    comparisons = [c for c in _data(dag_run, "comparisons.json") if c["split"] == "test"]
    table = _table(report, "## Paired differences (test")
    pairs = list(dict.fromkeys((c["baseline"], c["metric"]) for c in comparisons))
    checked = 0
    for cells in table:
        for (baseline, metric), text in zip(pairs, cells[3:], strict=True):
            match = [c for c in comparisons if (c["system"], c["tau"], c["window"]) == _variant(cells)
                     and (c["baseline"], c["metric"]) == (baseline, metric)]  # fmt: skip
            assert len(match) == (1 if text else 0)
            if text:
                _assert_cell(text, match[0]["mean_diff"], [match[0]["low"], match[0]["high"]])
                checked += 1
    assert checked == len(comparisons) > 0

    reasoning = [r for r in _data(dag_run, "reasoning_metrics.json") if r["split"] == "test"]
    table = _table(report, "## Reasoning quality (test")
    assert [_variant(c) for c in table] == [(r["system"], r["tau"], r["window"]) for r in reasoning]
    assert {r["system"] for r in reasoning} == {"ar_sft", "ar_rl", "naive", "cft", "opd", "rl", "distilled"}
    for cells, row in zip(table, reasoning, strict=True):
        for metric, text in zip(REASONING_METRICS, cells[4:], strict=True):
            _assert_cell(text, row[metric], row["ci"][metric])


@pytest.mark.slow
def test_benchmark_rerenders_the_report_with_its_table(dag_run: Path, reports: dict) -> None:
    report = reports["after"]
    assert (
        all(heading in report for heading in SECTIONS)
        and "is absent from this run: `make benchmark`" not in report
    )
    rows = _data(dag_run, "benchmark.json")
    table = _table(report, "## Decode benchmark")
    assert len(table) == len(rows) > 0
    for cells, row in zip(table, rows, strict=True):
        assert (_variant(cells), int(cells[4]), cells[5] == "grammar") == (
            (row["system"], row["tau"], row["window"]),
            row["batch_size"],
            row["constrained"],
        )
        for (key, _, digits), text in zip(BENCHMARK_COLUMNS, cells[6:-1], strict=True):
            assert float(text) == pytest.approx(row[key], abs=0.51 * 10**-digits), key
        if row["speedup_vs_ar"] is None:  # the last column: the speed-up with its interval
            assert cells[-1] == "—"
        else:
            _assert_cell(
                cells[-1], row["speedup_vs_ar"], [row["speedup_vs_ar_low"], row["speedup_vs_ar_high"]]
            )
    assert "](plots/speedup_by_batch.png)" in report
    timed = [r for r in rows if r["batch_size"] == 1 and r["constrained"] and r["system"] != "generate"]
    assert timed and "no benchmark.json" not in report


@pytest.mark.slow
def test_report_and_reasoning_metrics_are_logged_to_mlflow(dag_run: Path, reports: dict) -> None:
    mlflow.set_tracking_uri(f"sqlite:///{dag_run / 'mlflow.db'}")
    client = mlflow.MlflowClient()

    def newest(pipeline: str) -> mlflow.entities.Run:
        return mlflow.search_runs(
            experiment_names=["diffusion-gr2"],
            filter_string=f"tags.pipeline = '{pipeline}'",
            order_by=["attributes.start_time DESC"],
            output_format="list",
        )[0]

    default, bench = newest("__default__"), newest("benchmark")
    logged = {a.path for a in client.list_artifacts(default.info.run_id)}
    assert {"report.md", "report.html", "reasoning_metrics.json"} <= logged
    plots = {a.path for a in client.list_artifacts(default.info.run_id, "plots")}
    assert {"plots/frontier.png", "plots/own_valid_rate.png", "plots/training_curves.png"} <= plots
    assert {"report.md", "report.html"} <= {a.path for a in client.list_artifacts(bench.info.run_id)}
    assert "reasoning.test.rl.tau0.9.grounded_rate" in default.data.metrics


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes_on_the_smoke_run(
    path: Path, dag_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DIFFUSION_GR2_PROJECT", str(dag_run))
    monkeypatch.setenv("DIFFUSION_GR2_ENV", "smoke")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    if path.name.startswith("01"):  # the frontier, redrawn
        assert any("image/png" in o.get("data", {}) for o in outputs)


def test_notebooks_are_committed_without_outputs() -> None:
    assert [p.name for p in NOTEBOOKS] == ["01_results.ipynb", "02_decode_walkthrough.ipynb"]
    for path in NOTEBOOKS:
        cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        assert cells and all(not c.outputs and c.execution_count is None for c in cells), path.name
