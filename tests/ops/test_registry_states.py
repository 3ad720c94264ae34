"""Every registry state a scheduled job can meet, answered by each command (`serve`, `registry show`,
`lineage`, `retrain`, and the gate's line of `make register`) in one line with its exit status (issue
58): an empty registry, the pre-rank as champion (no re-ranker passed the gate), the teacher as
champion, a refused challenger beside its champion; `retrain` also with no delivery, only
quarantined files, a missing store and a held lock.

The states are built directly with `MlflowClient` (versions with no files behind them: the commands
here read names, aliases and tags only); the Kedro session `retrain` opens is stood in for.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import mlflow
import pytest
from mlflow.exceptions import MlflowException

from diffusion_gr2.__main__ import ops
from diffusion_gr2.core.registry import registry
from tests.conftest import make_project_copy
from tests.ops.conftest import World
from tests.ops.test_retrain_command import HEADER, held_lines
from tests.ops.test_serve_fallback import REFUSED, register_and_gate

DIFFUSION, TEACHER, PRERANK = registry.DIFFUSION_MODEL, registry.TEACHER_MODEL, registry.PRERANK_MODEL
REFUSAL = "unforced_rate = 0.1900 < 0.5000"
PRERANK_LINE = (
    f"serving {PRERANK} v1 (the retriever's order (pre-rank)): {DIFFUSION} has no version; "
    f"{TEACHER} has no champion (v1: gate refuse: {REFUSAL})"
)
EMPTY_LINE = (
    f"nothing to serve: {DIFFUSION} has no version; {TEACHER} has no version; {PRERANK} has no version "
    "(run `make register` after `make run`)"
)
REFUSED_LINE = (
    f"serving {DIFFUSION} v1 (the diffusion re-ranker): its champion; "
    f"{DIFFUSION} v2 was refused by the gate: {REFUSAL}"
)


def add_version(name: str, tags: dict[str, str] | None = None, champion: bool = False) -> str:
    """A new version of `name` (the `challenger`), optionally made `champion`; its version."""
    client = mlflow.MlflowClient()
    with contextlib.suppress(MlflowException):  # registered by an earlier version
        client.create_registered_model(name)
    with mlflow.start_run() as run:
        pass
    run_id = run.info.run_id
    version = client.create_model_version(name, f"runs:/{run_id}/model", run_id=run_id, tags=tags).version
    client.set_registered_model_alias(name, registry.CHALLENGER, version)
    if champion:
        client.set_registered_model_alias(name, registry.CHAMPION, version)
    return str(version)


def refused(**tags: str) -> dict[str, str]:
    return {"gate.decision": "refuse", "gate.reasons": REFUSAL, **tags}


def empty() -> None:
    """Nothing registered: no run has been registered yet."""


def prerank() -> None:
    """A default run put no re-ranker past the gate: the diffusion model had no operating point (not
    registered), the teacher was refused, the pre-rank is champion."""
    add_version(TEACHER, refused(system="ar_rl"))
    add_version(PRERANK, {"system": "prerank", "gate.decision": "promote"}, champion=True)


def teacher() -> None:
    """The diffusion model refused, the teacher promoted: the teacher serves."""
    add_version(DIFFUSION, refused(system="distilled"))
    add_version(TEACHER, {"system": "ar_rl", "gate.decision": "promote"}, champion=True)
    add_version(PRERANK, {"system": "prerank"})


def challenger() -> None:
    """A diffusion champion, and a newer version the gate refused (the champion kept serving)."""
    add_version(DIFFUSION, {"system": "distilled", "gate.decision": "promote"}, champion=True)
    add_version(DIFFUSION, refused(system="distilled"))
    add_version(TEACHER, {"system": "ar_rl", "gate.decision": "promote"}, champion=True)


STATES: dict[str, Callable[[], None]] = {
    "empty": empty,
    "prerank": prerank,
    "teacher": teacher,
    "challenger": challenger,
}


_LOG_LINE = re.compile(r"^(\[\d\d/\d\d/\d\d \d\d:\d\d:\d\d\]| {10,}|\s*$)")


def _answer_line(text: str) -> str:
    """The command's answer without Kedro's log lines (rich's `[date] LEVEL ...` and its indented
    continuations), which reach the captured stream once a Kedro session in the same process has
    configured logging: whether they do depends on which tests ran first."""
    return "".join(line + "\n" for line in text.splitlines() if not _LOG_LINE.match(line))


def answer(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()  # what building the state printed
    status = ops(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return status, _answer_line(out), _answer_line(err)


# ---- serve ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "status", "line"),
    [
        ("empty", 1, EMPTY_LINE),
        ("prerank", 0, PRERANK_LINE),
        (
            "teacher",
            0,
            f"serving {TEACHER} v1 (the AR teacher): "
            f"{DIFFUSION} has no champion (v1: gate refuse: {REFUSAL})",
        ),
        ("challenger", 0, REFUSED_LINE),
    ],
)
def test_serve_says_what_serves_in_every_state(
    store: str, state: str, status: int, line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    STATES[state]()
    got, out, err = answer(["serve", "--which"], capsys)
    assert got == status
    assert (out, err) == ((line + "\n", "") if status == 0 else ("", line + "\n"))


# ---- registry show -------------------------------------------------------------------------------


def rows(out: str) -> list[str]:
    """The printout without run ids (each row ends with one)."""
    return [line.rsplit("  run ", 1)[0] for line in out.splitlines()]


def test_registry_show_on_an_empty_registry_is_one_line_and_status_1(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert answer(["registry", "show"], capsys) == (
        1,
        "",
        f"the registry at {store} holds no version of {DIFFUSION}, {TEACHER}, {PRERANK}: "
        "run `make register` after `make run`\n",
    )


def test_registry_show_with_the_prerank_as_champion(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    prerank()
    status, out, err = answer(["registry", "show"], capsys)
    assert status == 0 and err == ""
    assert rows(out) == [
        f"{TEACHER} v1  aliases challenger  tau None  gate refuse",
        f"{PRERANK} v1  aliases challenger,champion  tau None  gate promote",
        PRERANK_LINE,
    ]


def test_registry_show_with_a_refused_challenger(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    challenger()
    status, out, err = answer(["registry", "show"], capsys)
    assert status == 0 and err == ""
    assert rows(out) == [
        f"{DIFFUSION} v2  aliases challenger  tau None  gate refuse",
        f"{DIFFUSION} v1  aliases champion  tau None  gate promote",
        f"{TEACHER} v1  aliases challenger,champion  tau None  gate promote",
        REFUSED_LINE,
    ]


# ---- lineage -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "line"),
    [
        (
            "empty",
            f"no registered model '{DIFFUSION}'; nothing serves yet: run `make register` after `make run`",
        ),
        (
            "prerank",
            f"no registered model '{DIFFUSION}'; {PRERANK} v1 serves: `lineage models:/{PRERANK}@champion`",
        ),
        (
            "teacher",
            f"no alias 'champion' on registered model {DIFFUSION} (aliases: challenger); "
            f"{TEACHER} v1 serves: `lineage models:/{TEACHER}@champion`",
        ),
    ],
)
def test_lineage_of_a_missing_champion_names_what_serves(
    store: str, state: str, line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    STATES[state]()
    assert answer(["lineage", f"models:/{DIFFUSION}@champion"], capsys) == (1, "", line + "\n")


def test_lineage_of_the_prerank_says_it_has_no_model_folder(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    prerank()
    status, out, err = answer(["lineage", f"models:/{PRERANK}@champion"], capsys)
    run_id = registry.alias_version(PRERANK, registry.CHAMPION).run_id
    assert status == 0 and err == ""
    header, line = out.splitlines()
    assert header.startswith(f"{PRERANK} version 1  aliases ['challenger', 'champion']  run {run_id}")
    assert line == (
        f"{PRERANK} v1 is the retriever's order: no model folder, no weights; "
        f"the run that registered it: `lineage {run_id}`"
    )


def test_lineage_of_a_refused_challenger_answers(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    challenger()
    status, out, err = answer(["lineage", f"models:/{DIFFUSION}@challenger"], capsys)
    assert status == 0 and err == ""
    header, line = out.splitlines()
    assert header.startswith(f"{DIFFUSION} version 2  aliases ['challenger']") and "gate refuse" in header
    assert line.startswith(
        f"{DIFFUSION} v2 has no model folder on record "
        "(no lineage.model tags: registered outside a Kedro run)"
    )


# ---- register (`make register`: the registration pipeline's nodes) ---------------------------------


def test_register_over_the_prerank_champion_answers_in_one_line(
    store: str,
    world: World,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A second `make register` with no re-ranker good enough again: the new pre-rank takes over, and
    the gate's one log line says so (the teacher's refusal is the line before it)."""
    register_and_gate(world, tmp_path, REFUSED, min_unforced_rate=0.5)  # the pre-rank v1 serves
    with caplog.at_level(logging.INFO, logger="diffusion_gr2.core.registry.promotion"):
        report = register_and_gate(world, tmp_path, REFUSED, min_unforced_rate=0.5)
    said = [r.getMessage() for r in caplog.records if r.name == "diffusion_gr2.core.registry.promotion"]
    assert said[-1] == f"gate: diffusion not_registered, teacher refuse; {report['serving']}"
    assert said[-2].startswith(f"gate refused {TEACHER} v2: unforced_rate = ")
    assert report["serving"].startswith(
        f"serving {PRERANK} v2 (the retriever's order (pre-rank)): {DIFFUSION} has no version; "
        f"{TEACHER} has no champion (v2: gate refuse: unforced_rate = "
    )
    assert answer(["serve", "--which"], capsys) == (0, report["serving"] + "\n", "")


# ---- retrain -------------------------------------------------------------------------------------

STAYS = "(on the same data a retrain trains the same models: `retrain --force` to run one anyway)"
ON_RUN: list[Callable[[], None]] = []  # what a test's stand-in Kedro run leaves (its registration)


@pytest.fixture
def project(store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, list]]:
    """A project copy as the working directory (no incoming folder: nothing was ever delivered), and
    the Kedro runs `retrain` would start, recorded; each run calls what the test put in `ON_RUN`."""
    root = make_project_copy(tmp_path / "project")
    monkeypatch.chdir(root)
    runs: list = []

    class Session:  # stands in for KedroSession
        @classmethod
        def create(cls, **kwargs):
            return cls()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def run(self, pipeline_names):
            runs.append(pipeline_names)
            for hook in ON_RUN:
                hook()

    ON_RUN.clear()
    monkeypatch.setattr("kedro.framework.session.KedroSession", Session)
    monkeypatch.setattr("kedro.framework.startup.bootstrap_project", lambda path: None)
    yield root, runs
    ON_RUN.clear()


@pytest.mark.parametrize(
    ("state", "stays"),
    [
        ("prerank", f"{PRERANK} v1 (the retriever's order (pre-rank)) stays champion {STAYS}"),
        ("teacher", f"{TEACHER} v1 (the AR teacher) stays champion {STAYS}"),
        ("challenger", f"{DIFFUSION} v1 stays champion"),
    ],
)
def test_retrain_with_no_delivery_trains_nothing_and_says_what_serves(
    project: tuple[Path, list], state: str, stays: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root, runs = project
    STATES[state]()
    before = {name: versions(name) for name in registry.SERVING_ORDER}
    assert answer(["retrain"], capsys) == (
        0,
        f"no delivery in data/01_raw/incoming: no retrain, {stays}\n",
        "",
    )
    assert runs == [] and {name: versions(name) for name in registry.SERVING_ORDER} == before
    report = json.loads((root / "data/08_reporting/retrain/ingest_without_retrain.json").read_text())
    assert report["files"] == [] and report["quarantined"] == 0


def test_retrain_with_only_quarantined_files_is_status_1(
    project: tuple[Path, list], capsys: pytest.CaptureFixture[str]
) -> None:
    root, runs = project
    prerank()
    incoming = root / "data/01_raw/incoming"
    incoming.mkdir(parents=True)
    (incoming / "ml-100k.broken.inter").write_text(held_lines(3) + "7\tnot-a-row\n")
    (incoming / "notes.txt").write_text("not interactions\n")
    status, out, err = answer(["retrain"], capsys)
    assert status == 1 and runs == []
    assert err == (
        "every file delivered to data/01_raw/incoming was quarantined (2 file(s), each beside its "
        f".reason.txt in data/01_raw/quarantine): no retrain, {PRERANK} v1 (the retriever's order "
        f"(pre-rank)) stays champion {STAYS}\n"
    )
    assert sorted(p.name for p in (root / "data/01_raw/quarantine").iterdir()) == [
        "ml-100k.broken.inter",
        "ml-100k.broken.inter.reason.txt",
        "notes.txt",
        "notes.txt.reason.txt",
    ]
    # taken in: the next night has nothing delivered, and says so with status 0
    status, out, _ = answer(["retrain"], capsys)
    assert (status, out.split(":")[0]) == (0, "no delivery in data/01_raw/incoming")


def versions(name: str) -> list[str]:
    try:
        return sorted(v["version"] for v in registry.version_summary(name))
    except registry.NotFoundError:
        return []


def write_gate(root: Path, gate: dict) -> None:
    path = root / "data/08_reporting/retrain/gate.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(gate))


def test_retrain_on_an_empty_registry_runs_the_full_recipe_and_says_what_came_of_it(
    project: tuple[Path, list], capsys: pytest.CaptureFixture[str]
) -> None:
    root, runs = project

    def registration() -> None:  # what the retrain's registration leaves when no re-ranker passes
        prerank()
        write_gate(
            root,
            {"decision": "not_registered", "challenger_version": None, "teacher_version": "1"}
            | {"teacher_gate": {"decision": "refuse"}, "serving": PRERANK_LINE},
        )

    ON_RUN.append(registration)
    assert answer(["retrain"], capsys) == (
        0,
        "retrained (no champion serves yet); gate: diffusion-gr2 not registered, diffusion-gr2-teacher v1 "
        f"refused (data/08_reporting/retrain/gate.json); {PRERANK_LINE}\n",
        "",
    )
    assert runs == [["retrain"]]


def test_retrain_whose_challenger_is_refused_says_the_champion_serves(
    project: tuple[Path, list], capsys: pytest.CaptureFixture[str]
) -> None:
    root, runs = project
    add_version(DIFFUSION, {"system": "distilled", "gate.decision": "promote"}, champion=True)
    add_version(TEACHER, {"system": "ar_rl", "gate.decision": "promote"}, champion=True)
    incoming = root / "data/01_raw/incoming"
    incoming.mkdir(parents=True)
    (incoming / "ml-100k.fresh.inter").write_text(HEADER + "\n1\t1682\t4\t999999999\n")  # a new pair

    def registration() -> None:
        add_version(DIFFUSION, refused(system="distilled"))
        add_version(TEACHER, refused(system="ar_rl"))
        write_gate(
            root,
            {"decision": "refuse", "challenger_version": "2", "teacher_version": "2"}
            | {"teacher_gate": {"decision": "refuse"}, "serving": "ignored: read from the registry"},
        )

    ON_RUN.append(registration)
    status, out, err = answer(["retrain"], capsys)
    assert (status, err) == (0, "") and runs == [["retrain"]]
    assert out == (
        "retrained (1 new rows in data/01_raw/incoming; drift: 1 delivered rows < drift.min_rows 50: not "
        f"judged); gate: {DIFFUSION} v2 refused, {TEACHER} v2 refused (data/08_reporting/retrain/gate.json); "
        f"{REFUSED_LINE}\n"
    )


def test_retrain_with_no_store_makes_one_and_runs_the_full_recipe(
    project: tuple[Path, list],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, runs = project
    db = tmp_path / "none-yet" / "mlflow.db"
    db.parent.mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    status, out, _ = answer(["retrain"], capsys)  # stderr: MLflow creating the store's tables
    assert (status, out) == (
        0,
        f"retrained (no champion serves yet); this retrain wrote no gate report; {EMPTY_LINE}\n",
    )
    assert runs == [["retrain"]] and db.exists()


def test_retrain_while_another_holds_the_lock_is_one_line_and_status_1(
    project: tuple[Path, list], capsys: pytest.CaptureFixture[str]
) -> None:
    root, runs = project
    prerank()
    lock = root / "data/01_raw/incoming/.retrain.lock"
    lock.parent.mkdir(parents=True)
    lock.write_text(str(os.getppid()))  # a live process that is not this one
    assert answer(["retrain"], capsys) == (
        1,
        "",
        f"a retrain (pid {os.getppid()}) holds data/01_raw/incoming/.retrain.lock; wait for it or remove "
        "a stale lock\n",
    )
    assert runs == [] and lock.read_text() == str(os.getppid())
