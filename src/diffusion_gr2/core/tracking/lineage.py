"""Lineage facts for run tags: the code commit and the DVC hashes of the data (DESIGN §9)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml


def git_commit(project_dir: Path) -> dict[str, str]:
    """The checked-out commit and whether the tree has uncommitted changes ("unknown" outside git)."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=project_dir, capture_output=True, text=True, check=False, timeout=10
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit, "git_dirty": str(bool(dirty)).lower()}


def dvc_hashes(project_dir: Path) -> dict[str, str]:
    """``dvc.<stage>.<path>`` → md5 for every dependency and output recorded in ``dvc.lock``."""
    lock_path = project_dir / "dvc.lock"
    if not lock_path.exists():
        return {}
    lock = yaml.safe_load(lock_path.read_text()) or {}
    tags: dict[str, str] = {}
    for stage, entry in (lock.get("stages") or {}).items():
        for kind in ("deps", "outs"):
            for item in entry.get(kind) or []:
                digest = item.get("md5") or item.get("hash") or ""
                if digest:
                    tags[f"dvc.{stage}.{item['path']}"] = str(digest)
    return tags
