"""Drift of a delivery against the champion's training window (`core.monitoring.drift`), and how the
retrain decision uses it (strong drift below the new-rows minimum)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from diffusion_gr2.core.data.recbole import embedded_ml100k_folder
from diffusion_gr2.core.monitoring.drift import CHECKS, DriftConfig, drift_report, render_html
from diffusion_gr2.core.monitoring.ingest import IngestConfig
from diffusion_gr2.core.monitoring.retrain_decision import decide_retrain
from diffusion_gr2.pipelines.retrain.decision import drift_outputs
from tests.conftest import PROJECT_ROOT, make_project_copy
from tests.ops.conftest import World
from tests.ops.test_retrain_command import HEADER
from tests.ops.test_retrain_decision import champion

BASE = yaml.safe_load((PROJECT_ROOT / "conf/base/parameters_retrain.yml").read_text())["retrain"]
CONFIG = DriftConfig(**BASE["drift"])  # the shipped thresholds


def interactions(rng: np.random.Generator, rows: int, users: int = 300, items: int = 400) -> pd.DataFrame:
    """A synthetic log: Zipf item popularity, ratings mostly 3-5, each user active at Poisson times."""
    popularity = 1.0 / np.arange(1, items + 1) ** 1.1
    user = rng.integers(0, users, rows)
    start = rng.uniform(0, 3e7, users)
    return pd.DataFrame(
        {
            "raw_user_id": user.astype(str),
            "raw_item_id": rng.choice(items, rows, p=popularity / popularity.sum()).astype(str),
            "timestamp": (start[user] + rng.exponential(4e5, rows).cumsum() % 3e6).astype("int64"),
            "rating": rng.choice([1.0, 2.0, 3.0, 4.0, 5.0], rows, p=[0.05, 0.1, 0.25, 0.35, 0.25]),
        }
    )


def split(
    frame: pd.DataFrame, rng: np.random.Generator, share: float = 0.2
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A random resample of the rows as the delivery, the rest as the reference: one distribution."""
    delivered = rng.random(len(frame)) < share
    return frame[~delivered].reset_index(drop=True), frame[delivered].reset_index(drop=True)


def plant(
    check: str, delivery: pd.DataFrame, reference: pd.DataFrame, rng: np.random.Generator
) -> pd.DataFrame:
    """`delivery` with one shift planted, aimed at `check`."""
    shifted = delivery.copy()
    some = rng.random(len(shifted)) < 0.6
    if check == "new_users":
        shifted.loc[some, "raw_user_id"] = "new-" + shifted.loc[some, "raw_user_id"]
    elif check == "new_items":
        shifted.loc[rng.random(len(shifted)) < 0.2, "raw_item_id"] = "fresh-item"
    elif check == "item_popularity":  # the long tail takes over: items drawn uniformly
        shifted["raw_item_id"] = rng.choice(reference["raw_item_id"].unique(), len(shifted))
    elif check == "history_length":  # the delivery comes from the users' first days
        first = reference.groupby("raw_user_id")["timestamp"].min()
        shifted["timestamp"] = first.reindex(shifted["raw_user_id"]).fillna(0).to_numpy("int64") - 10
    elif check == "rating":
        shifted["rating"] = rng.choice([1.0, 2.0], len(shifted))
    elif check == "time_gap":  # bursts: every row a second after the user's previous one
        shifted = shifted.sort_values(["raw_user_id", "timestamp"])
        shifted["timestamp"] = shifted.groupby("raw_user_id")["timestamp"].transform("min") + (
            shifted.groupby("raw_user_id").cumcount() * 1 + 40_000_000
        )
    return shifted.reset_index(drop=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_resample_of_the_same_distribution_passes_every_check(seed: int) -> None:
    rng = np.random.default_rng(seed)
    reference, delivery = split(interactions(rng, 20_000), rng)
    report = drift_report(reference, delivery, CONFIG)
    assert report["judged"] and report["drifted"] == [] and not report["strong"]
    assert {c["check"] for c in report["checks"]} == set(CHECKS)
    values = {c["check"]: c for c in report["checks"]}
    assert values["new_users"]["value"] == 0.0 and values["item_popularity"]["p_value"] > CONFIG.alpha


@pytest.mark.parametrize("check", CHECKS)
def test_a_planted_shift_is_caught_by_its_check(check: str) -> None:
    rng = np.random.default_rng(7)
    reference, delivery = split(interactions(rng, 20_000), rng)
    report = drift_report(reference, plant(check, delivery, reference, rng), CONFIG)
    found = next(c for c in report["checks"] if c["check"] == check)
    assert found["drifted"], found
    assert found["value"] > found["threshold"] and found.get("p_value", 0.0) < CONFIG.alpha
    assert check in report["summary"]


def test_a_small_delivery_is_not_judged_and_says_so() -> None:
    rng = np.random.default_rng(3)
    reference, delivery = split(interactions(rng, 2_000), rng)
    report = drift_report(reference, delivery.head(CONFIG.min_rows - 1), CONFIG)
    assert not report["judged"] and report["drifted"] == [] and "not judged" in report["summary"]
    assert all("skipped" in c for c in report["checks"])


def test_the_page_is_self_contained_and_marks_each_drifted_check() -> None:
    rng = np.random.default_rng(4)
    reference, delivery = split(interactions(rng, 5_000), rng)
    page = render_html(drift_report(reference, plant("rating", delivery, reference, rng), CONFIG))
    assert page.startswith("<!doctype html>") and "<script" not in page and "src=" not in page
    assert "<tr class='drift'><td>rating</td>" in page and "<tr class='ok'><td>new_items</td>" in page


@pytest.mark.parametrize(
    ("new_rows", "why"), [(0, "no delivered rows"), (12, "retrain.drift.enabled is false")]
)
def test_a_retrain_without_a_drift_report_still_writes_its_page(new_rows: int, why: str) -> None:
    """A retrain with nothing delivered (nothing serving yet, or forced) or with the drift checks off
    has no report to render: the page says so instead of failing the retrain (issue 58)."""
    decision = {"retrain": True, "reason": "no champion serves yet", "new_rows": new_rows}
    out = drift_outputs(decision | {"trigger": "no_champion", "drift": None})
    report = out["drift_report"]
    assert report["summary"] == f"no drift report: {why} (no champion serves yet)"
    assert report["trigger"] == "no_champion" and not report["judged"] and "reference" not in report
    page = out["drift_html"]
    assert page.startswith("<!doctype html>") and page.endswith("</html>")
    assert "<p>No delivered rows: nothing was compared.</p>" in page
    assert f"<p>no drift report: {why} (no champion serves yet)</p>" in page
    assert "<tr class=" not in page  # no check rows
    assert render_html({}).endswith("</html>")  # any report renders


# ---- the retrain decision ------------------------------------------------------------------------


@pytest.fixture
def project(store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = make_project_copy(tmp_path / "project")
    monkeypatch.chdir(root)
    (root / "data/01_raw/incoming").mkdir(parents=True)
    yield root


def ml100k_rows(n: int, seed: int) -> pd.DataFrame:
    lines = (embedded_ml100k_folder() / "ml-100k.inter").read_text().splitlines()[1:]
    rows = pd.DataFrame([line.split("\t") for line in lines], columns=["user", "item", "rating", "time"])
    return rows.sample(n, random_state=seed).reset_index(drop=True)


def deliver(project: Path, rows: pd.DataFrame, name: str) -> None:
    body = "\n".join("\t".join(map(str, r)) for r in rows.itertuples(index=False))
    (project / "data/01_raw/incoming" / name).write_text(f"{HEADER}\n{body}\n")


def decide(drift: DriftConfig, min_new_rows: int):
    import mlflow

    return decide_retrain(
        IngestConfig(), "data/01_raw/incoming/.retrain.lock", False, mlflow.MlflowClient(),
        drift=drift, min_new_rows=min_new_rows,
    )  # fmt: skip


def test_strong_drift_forces_a_retrain_below_the_minimum_and_the_decision_says_which(
    project: Path, world: World
) -> None:
    version = champion(world)
    incoming = project / "data/01_raw/incoming"
    # MovieLens rows with their items swapped among them: new lines, the same distribution
    same = ml100k_rows(200, seed=0)
    same["item"] = same["item"].sample(frac=1.0, random_state=1).to_numpy()
    deliver(project, same, "ml-100k.same.inter")
    waiting = decide(CONFIG, min_new_rows=1000)
    assert not waiting.retrain and waiting.trigger == "waiting" and waiting.champion_version == version
    assert waiting.drift is not None and waiting.drift["judged"] and waiting.drift["drifted"] == []
    source = waiting.drift["reference"]["source"]  # the test's champion was registered outside Kedro
    assert (
        source
        == f"the raw folder before this delivery (v{version} has no raw files on record that still hold their hash)"
    )
    assert "wait there for more" in waiting.reason and "no drift" in waiting.reason
    assert sorted(p.name for p in incoming.iterdir()) == ["ml-100k.same.inter"]  # nothing moved
    # strong drift: users and items nobody has seen, rated 1
    shifted = ml100k_rows(200, seed=2).assign(rating="1")
    shifted["user"] = "new-" + shifted["user"]
    shifted.loc[::3, "item"] = "9" + shifted.loc[::3, "item"] + "0000"
    deliver(project, shifted, "ml-100k.shifted.inter")
    forced = decide(CONFIG, min_new_rows=1000)
    assert forced.retrain and forced.trigger == "drift" and forced.new_rows == waiting.new_rows + 200
    assert forced.drift["strong"] and {"new_users", "new_items", "rating"} <= set(forced.drift["drifted"])
    assert forced.reason.startswith(
        f"strong drift forces a retrain on {forced.new_rows} new rows (< min_new_rows 1000)"
    )
    assert forced.drift["delivery"]["files"] == ["ml-100k.same.inter", "ml-100k.shifted.inter"]
    quiet = decide(replace(CONFIG, force_retrain=False), min_new_rows=1000)
    assert not quiet.retrain and quiet.trigger == "waiting" and "strong drift" in quiet.reason
    enough = decide(CONFIG, min_new_rows=1)
    assert enough.retrain and enough.trigger == "new_rows" and "strong drift" in enough.reason
    # the node's outputs: the report with where it came from, and its page
    out = drift_outputs(asdict(forced))
    assert out["drift_report"]["trigger"] == "drift" and out["drift_report"]["run_id"] is None
    assert json.loads(json.dumps(out["drift_report"]))["checks"] == forced.drift["checks"]
    assert "<tr class='drift'><td>new_items</td>" in out["drift_html"]
