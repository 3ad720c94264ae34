"""Old module paths that registered versions still name, answered with the modules' new homes.

A registered version's pyfunc model is pickled by reference: `python_model.pkl` names its class by
module path, and loading the version imports that path. Versions registered while the served model
lived in `core/tracking/` (before the operations code was split into packages) name
``diffusion_gr2.core.tracking.serving``; without this alias they no longer load, so neither `make
serve`, the batch re-rank nor the gate's champion could use them. Nothing in the project imports
the old path. Installed by the package's ``__init__``: an unpickling imports ``diffusion_gr2`` first.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType

# old path -> new path; only what a pickled model names (`serving.RerankerModel`, `PrerankModel`)
MOVED = {"diffusion_gr2.core.tracking.serving": "diffusion_gr2.core.serving.serving"}
# the old packages above them, empty: importing a child imports its parents first
OLD_PACKAGES = frozenset({"diffusion_gr2.core.tracking"})


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds only the old names; an old module's import gives the new module itself (same classes)."""

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname in MOVED or fullname in OLD_PACKAGES:
            return importlib.util.spec_from_loader(fullname, self, is_package=fullname in OLD_PACKAGES)
        return None

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return None  # the default: a blank module, replaced below for a moved one

    def exec_module(self, module: ModuleType) -> None:
        new = MOVED.get(module.__name__)
        if new is not None:  # the import system returns what sys.modules holds after this
            sys.modules[module.__name__] = importlib.import_module(new)


def install() -> None:
    """Append the finder once: the real import path is searched first, so a real module always wins."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
