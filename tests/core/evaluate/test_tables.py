"""One table renderer (`core/evaluate/tables.py`) serves the three tables of a run's stage rows:
`stage_metrics.md` (`rankings.metrics_markdown`), the report's stage table and the results table.

The three outputs are pinned to what they printed before they shared it (`golden_tables.md`, the
same rows rendered by the code of commit 037ed68, with the `prerank_copy_rate` and
`copy_against_evidence_rate` columns, the results table's copies column and the stage table's paired
columns added since): output unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

from diffusion_gr2.core.evaluate.rankings import metrics_markdown
from diffusion_gr2.core.evaluate.report import ReportInputs, render_markdown
from diffusion_gr2.core.evaluate.results import results_table
from tests.core.evaluate.test_results import paired, reporting, stage

GOLDEN = Path(__file__).with_name("golden_tables.md")


def render_all(tmp_path: Path) -> str:
    """Every table of the stage rows, as each renderer prints it, with a served and a refused rl."""
    out = []
    for refused in (False, True):
        (tmp_path / str(refused)).mkdir()
        folder = reporting(tmp_path / str(refused), refused=refused)
        rows = json.loads((folder / "stage_metrics.json").read_text())
        rows.append(stage("rl", 0.9, 2, 0.22, 0.6))
        comparisons = [
            *json.loads((folder / "comparisons.json").read_text()),
            paired("rl", 0.9, "prerank", -0.02),
        ]
        points = json.loads((folder / "operating_point.json").read_text())
        bench = json.loads((folder / "benchmark.json").read_text())
        out.append(metrics_markdown(rows))
        out.append(results_table(rows, comparisons, points, bench))
        out.append(results_table(rows, comparisons, points, None))
        decoding = [
            {k: r[k] for k in ("split", "system", "tau", "window", "n")}
            | {"mean_output_tokens": 10.0, "mean_nfe": 4.0, "tokens_per_forward": 2.5}
            for r in rows
        ]
        out.append(render_markdown(ReportInputs(rows, comparisons, [], decoding, points), {}))
    return "\n=====\n".join(out) + "\n"


def test_the_three_tables_print_what_they_printed_before_sharing_one_renderer(tmp_path: Path) -> None:
    assert render_all(tmp_path) == GOLDEN.read_text()


def test_the_three_renderers_are_one() -> None:
    from diffusion_gr2.core.evaluate import rankings, report, results, tables

    assert rankings.markdown_table is report.markdown_table is results.markdown_table is tables.markdown_table
    assert (
        rankings.metric_cell is tables.metric_cell and report.interval is results.interval is tables.interval
    )
    assert tables.markdown_table(["a", "b"], [["1", "2"]]) == "| a | b |\n|---|---|\n| 1 | 2 |"


def test_an_interval_prints_its_sign_digits_and_what_is_missing() -> None:
    from diffusion_gr2.core.evaluate import tables

    assert tables.interval(0.18541, 0.1192, 0.2523) == "0.1854 [0.119, 0.252]"
    assert tables.interval(0.0132, -0.053, 0.073, signed=True) == "+0.0132 [-0.053, +0.073]"
    assert tables.interval(2.4, 2.3, 2.5, 2, 2) == "2.40 [2.30, 2.50]"
    assert (
        tables.interval(None, 0, 0, empty="-") == "-"
        and tables.interval(float("nan"), 0, 0, empty="-") == "-"
    )
    assert tables.tau_cell({"tau": 0.9}) == "0.9" and tables.tau_cell({"tau": None}) == "—"
    assert tables.window_cell({"window": 4}) == "4" and tables.window_cell({}) == "—"
