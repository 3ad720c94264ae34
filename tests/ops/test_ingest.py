"""Taking in fresh files: whole-file validation, quarantine, dedup merge, and the retrain lock."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diffusion_gr2.core.monitoring.ingest import (
    IngestConfig,
    RetrainLockedError,
    acquire_lock,
    ingest,
    release_lock,
)

HEADER = "user_id:token\titem_id:token\trating:float\ttimestamp:float"


def inter(rows: list[tuple[int, int, int, int]]) -> str:
    return "\n".join([HEADER, *(f"{u}\t{i}\t{r}\t{t}" for u, i, r, t in rows)]) + "\n"


@pytest.fixture
def project(tmp_path: Path) -> IngestConfig:
    raw = tmp_path / "raw" / "toy"
    raw.mkdir(parents=True)
    (raw / "toy.inter").write_text(inter([(1, 10, 5, 100), (1, 11, 4, 101), (2, 10, 3, 102)]))
    (tmp_path / "incoming").mkdir()
    return IngestConfig(
        incoming_dir=str(tmp_path / "incoming"),
        quarantine_dir=str(tmp_path / "quarantine"),
        raw_root=str(tmp_path / "raw"),
        dataset="toy",
    )


def raw_state(config: IngestConfig) -> dict[str, bytes]:
    folder = Path(config.raw_root) / config.dataset
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def drop(config: IngestConfig, name: str, data: str | bytes) -> None:
    path = Path(config.incoming_dir) / name
    path.write_bytes(data.encode() if isinstance(data, str) else data)


def test_good_file_merges_new_rows_and_the_same_file_again_changes_nothing(project: IngestConfig) -> None:
    fresh = inter([(1, 11, 4, 101), (2, 12, 5, 200), (3, 10, 1, 201)])  # first row already held
    drop(project, "fresh.inter", fresh)
    report = ingest(project)
    (entry,) = report["files"]
    assert entry["status"] == "merged" and entry["rows"] == 3 and entry["new_rows"] == 2
    after_first = raw_state(project)
    assert len(after_first) == 2  # the original file untouched, one new file with the two new rows
    drop(project, "fresh.inter", fresh)  # the same file once more (a re-run of the same delivery)
    report = ingest(project)
    assert report["files"][0]["status"] == "duplicate" and report["new_rows"] == 0
    assert raw_state(project) == after_first
    assert (Path(project.incoming_dir) / "done" / "fresh.inter").exists()


@pytest.mark.parametrize(
    ("name", "data", "reason"),
    [
        ("broken.inter", inter([(1, 10, 5, 100)]) + "7\tnot-a-row\n", "rejected"),
        ("packed.inter", gzip.compress(inter([(4, 10, 5, 300)]).encode()), "CorruptFileError"),
        ("fresh.jsonl", '{"user_id": "u", "parent_asin": "a", "timestamp": 1}\n', "amazon2023"),
        ("notes.txt", "hello\n", "unrecognised"),
        ("empty.inter", HEADER + "\n", "no interaction rows"),
    ],
)
def test_a_bad_file_is_quarantined_with_its_reason_and_nothing_merged(
    project: IngestConfig, name: str, data: str | bytes, reason: str
) -> None:
    before = raw_state(project)
    drop(project, name, data)
    report = ingest(project)
    (entry,) = report["files"]
    assert entry["status"] == "quarantined" and reason in entry["reason"]
    assert raw_state(project) == before
    quarantine = Path(project.quarantine_dir)
    assert (quarantine / name).exists() and reason in (quarantine / f"{name}.reason.txt").read_text()
    assert not (Path(project.incoming_dir) / name).exists()


def test_the_lock_refuses_a_second_retrain_and_takes_over_a_dead_one(tmp_path: Path) -> None:
    lock = tmp_path / ".retrain.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(str(holder.pid))
        with pytest.raises(RetrainLockedError, match=str(holder.pid)):
            acquire_lock(lock)
    finally:
        holder.kill()
        holder.wait()
    acquire_lock(lock)  # the holder is gone: a stale lock is taken over
    assert lock.read_text() == str(os.getpid())
    release_lock(lock)
    assert not lock.exists()
