"""The results table renders from a constructed reporting folder, with every figure where it belongs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from diffusion_gr2.core.evaluate.metrics import METRICS
from diffusion_gr2.core.evaluate.results import ResultsError, results_markdown


def stage(system: str, tau: float | None, window: int | None, r1: float, own: float, n: int = 100) -> dict:
    figures = {m: r1 for m in METRICS} | {"recall@1": r1, "valid_rate": 1.0, "unforced_rate": own}
    ci = {m: [v - 0.05, v + 0.05] for m, v in figures.items()}
    return {"system": system, "tau": tau, "window": window, "split": "test", "n": n, **figures, "ci": ci}


def paired(system: str, tau: float | None, baseline: str, diff: float) -> dict:
    return {
        "system": system,
        "tau": tau,
        "window": None,
        "split": "test",
        "baseline": baseline,
        "metric": "recall@1",
        "mean_diff": diff,
        "low": diff - 0.04,
        "high": diff + 0.04,
    }


def bench(system: str, tau: float | None, batch: int, rounds: list[float], speedup: float | None) -> dict:
    return {
        "system": system,
        "tau": tau,
        "window": None,
        "batch_size": batch,
        "constrained": True,
        "output_tokens_per_s": sorted(rounds)[len(rounds) // 2],
        "tokens_per_s_by_round": rounds,
        "tokens_per_forward": 1.0 if tau is None else 2.5,
        "speedup_vs_ar": speedup,
        "speedup_vs_ar_low": None if speedup is None else speedup - 0.1,
        "speedup_vs_ar_high": None if speedup is None else speedup + 0.1,
    }


def write(folder: Path, name: str, content: object) -> None:
    (folder / name).write_text(json.dumps(content))


def reporting(folder: Path, refused: bool = False) -> Path:
    write(
        folder,
        "stage_metrics.json",
        [
            stage("prerank", None, None, 0.19, 1.0),
            stage("ar_rl", None, None, 0.18, 0.52),
            stage("rl", 0.6, None, 0.20, 0.53),
            stage("rl", 0.9, None, 0.21, 0.67, n=50),
            {**stage("rl", 0.6, None, 0.5, 0.5), "split": "valid"},  # validation never shows
        ],
    )
    write(
        folder,
        "comparisons.json",
        [
            paired("ar_rl", None, "prerank", -0.01),
            paired("rl", 0.6, "ar_rl", 0.02),
            paired("rl", 0.6, "prerank", 0.01),
            paired("rl", 0.9, "ar_rl", 0.03),
        ],
    )
    point = (
        {"tau": None, "window": None, "refused": "no setting"} if refused else {"tau": 0.6, "window": None}
    )
    write(folder, "operating_point.json", {"rl": point})
    write(
        folder,
        "benchmark.json",
        [
            bench("ar_rl", None, 1, [100.0, 110.0, 90.0, 100.0], 1.0),
            bench("ar_rl", None, 16, [400.0, 400.0, 400.0, 400.0], 1.0),
            bench("generate", None, 1, [120.0, 125.0, 115.0, 130.0], 1.2),
            bench("rl", 0.6, 1, [240.0, 250.0, 230.0, 260.0], 2.4),
            bench("rl", 0.6, 16, [520.0, 520.0, 520.0, 520.0], 1.3),
        ],
    )
    run = {
        "started": "2026-12-02T14:00:00+00:00",
        "pipelines": ["__default__"],
        "env": "local",
        "git_commit": "abcdef0123456789",
        "git_dirty": "false",
        "cpu_cores": 2,
        "torch_threads": 2,
        "gpu": None,
    }
    write(folder, "node_times.json", {"total_s": 1350.0, "nodes_s": {}, "run": run})
    return folder


def cells(table: str, system: str) -> list[str]:
    row = next(line for line in table.splitlines() if line.startswith(f"| {system} |"))
    return [c.strip() for c in row.strip("|").split("|")]


def test_the_table_holds_each_served_system_with_its_intervals_and_the_run_line(tmp_path: Path) -> None:
    table = results_markdown(reporting(tmp_path))
    rl = cells(table, "rl")
    assert rl[1] == "tau 0.6, whole block" and rl[2] == "100"
    assert rl[3] == "0.200 [0.150, 0.250]"
    assert rl[4] == "+0.020 [-0.020, +0.060]" and rl[5] == "+0.010 [-0.030, +0.050]"
    # own valid, of which copies (the fixture's prerank_copy_rate is its R@1), served valid, tokens/forward
    assert (rl[6], rl[7], rl[8], rl[9]) == ("0.53", "0.20", "1.00", "2.50")
    assert rl[10] == "2.40 [2.30, 2.50]x" and rl[11] == "1.30 [1.20, 1.40]x"
    # against the fastest AR row at batch 1 (generate, 120 a round), paired by round: 2.0 every round
    assert rl[12] == "2.00 [2.00, 2.00]x (generate)"
    ar = cells(table, "ar_rl")
    assert ar[4] == "-" and ar[5] == "-0.010 [-0.050, +0.030]" and ar[6] == "0.52"
    assert cells(table, "prerank")[9:] == ["-"] * 4
    assert table.count("| rl |") == 1  # the served setting only, not the sweep's tau 0.9
    assert "Run: 2026-12-02T14:00:00+00:00, commit abcdef0, env local, 2 CPU cores, 2 torch threads" in table
    assert "no GPU; 22.5 min" in table


def test_a_refused_operating_point_is_shown_as_not_served(tmp_path: Path) -> None:
    table = results_markdown(reporting(tmp_path, refused=True))
    rl = cells(table, "rl")
    assert rl[1] == "none: refused on validation (figures at tau 0.9, not served)" and rl[2] == "50"


def test_without_a_benchmark_the_speed_columns_say_so(tmp_path: Path) -> None:
    folder = reporting(tmp_path)
    (folder / "benchmark.json").unlink()
    assert cells(results_markdown(folder), "rl")[9] == "no benchmark.json"


def test_a_missing_run_report_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ResultsError, match="stage_metrics.json: not found; `make run` writes it"):
        results_markdown(tmp_path)


def test_the_command_prints_the_table_and_fails_clearly_without_a_run(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "diffusion_gr2", "results", "--reporting"]
    done = subprocess.run([*command, str(reporting(tmp_path))], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and done.stdout == results_markdown(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    done = subprocess.run([*command, str(empty)], capture_output=True, text=True, check=False)
    assert done.returncode == 1 and done.stderr.strip().endswith("(the results come from a run)")
    assert "Traceback" not in done.stderr


def test_the_report_starts_with_the_same_table(tmp_path: Path) -> None:
    from diffusion_gr2.core.evaluate.report import ReportInputs, render_markdown
    from diffusion_gr2.core.evaluate.results import results_table

    folder = reporting(tmp_path)
    (folder / "benchmark.json").unlink()  # the report's own benchmark section wants full rows
    read = {n: json.loads((folder / f"{n}.json").read_text()) for n in ("stage_metrics", "comparisons")}
    points = json.loads((folder / "operating_point.json").read_text())
    inputs = ReportInputs(read["stage_metrics"], read["comparisons"], [], [], points)
    report = render_markdown(inputs, {})
    table = results_table(read["stage_metrics"], read["comparisons"], points, None)
    first = report.index("\n## ")
    assert report[first:].startswith("\n## Results\n\n" + table)
    assert table in results_markdown(folder)


def test_the_analyst_sits_after_the_prerank_with_no_speed_figures(tmp_path: Path) -> None:
    """The learned analyst's noiseless order (the teacher's ceiling) is a row of the table, not served."""
    folder = reporting(tmp_path)
    stages = json.loads((folder / "stage_metrics.json").read_text())
    stages.insert(1, stage("analyst", None, None, 0.3, 1.0))
    write(folder, "stage_metrics.json", stages)
    write(folder, "comparisons.json", [*json.loads((folder / "comparisons.json").read_text()),
                                       paired("analyst", None, "prerank", 0.11)])  # fmt: skip
    table = results_markdown(folder)
    names = [line.split(" | ")[0].lstrip("| ") for line in table.splitlines() if line.startswith("| ")]
    assert names[1:4] == ["prerank", "analyst", "ar_rl"]
    analyst = cells(table, "analyst")
    assert analyst[1] == "teacher's ceiling, not served" and analyst[3] == "0.300 [0.250, 0.350]"
    assert analyst[5] == "+0.110 [+0.070, +0.150]" and analyst[9:] == ["-"] * 4
    assert "analyst: the learned analyst's noiseless order" in table
    (tmp_path / "without").mkdir()
    assert "analyst:" not in results_markdown(reporting(tmp_path / "without"))  # older runs: no row, no note
