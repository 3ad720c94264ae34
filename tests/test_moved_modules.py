"""Versions pickled under an old module path still load (`diffusion_gr2/moved_modules.py`)."""

from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys
from pathlib import Path

from diffusion_gr2.core.serving.serving import PrerankModel, RerankerModel
from diffusion_gr2.moved_modules import MOVED

ROOT = Path(__file__).resolve().parents[1]
OLD, NEW = "diffusion_gr2.core.tracking.serving", "diffusion_gr2.core.serving.serving"


def old_pickle(cls: type) -> bytes:
    """`cls` pickled by reference as a version registered under the old path names it (protocol 0:
    the path is plain text, so it can be swapped)."""
    return pickle.dumps(cls, protocol=0).replace(NEW.encode(), OLD.encode())


def test_an_old_path_gives_the_moved_classes_themselves() -> None:
    assert MOVED == {OLD: NEW}
    for cls in (RerankerModel, PrerankModel):
        assert OLD.encode() in old_pickle(cls)
        assert pickle.loads(old_pickle(cls)) is cls


def test_a_fresh_process_loads_an_old_pickle_without_importing_the_project_first(tmp_path: Path) -> None:
    # what `mlflow models serve` does: unpickle first; the old path's import runs the package's __init__
    (tmp_path / "model.pkl").write_bytes(old_pickle(PrerankModel))
    code = "import pickle, sys; print(pickle.load(open(sys.argv[1], 'rb')).__module__)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "model.pkl")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == NEW


def test_only_the_moved_modules_are_answered() -> None:
    assert importlib.util.find_spec("diffusion_gr2.core.tracking.registry") is None
    assert importlib.util.find_spec("diffusion_gr2.core.nowhere") is None
