"""core is layered: each package imports only packages at or below its own layer, and nothing of core
imports Kedro (docs/architecture.md#code-conventions). Every import counts: module-level, inside a
function (lazy), absolute or relative."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

CORE = "diffusion_gr2.core"
CORE_DIR = Path(__file__).resolve().parents[1] / "src" / "diffusion_gr2" / "core"

# Lowest first; a package imports only its own layer and those listed before it.
LAYERS: tuple[tuple[frozenset[str], str], ...] = (
    (
        frozenset({"io", "env", "base"}),
        "leaves: atomic writes, the process, the timing statistic, run manifests",
    ),
    (frozenset({"text"}), "the SID, prompt and answer formats every layer above writes or reads"),
    (frozenset({"data"}), "raw files to validated frames, SID strings checked in text's format"),
    (frozenset({"sid"}), "semantic IDs from the items' text"),
    (frozenset({"evaluate"}), "metrics, the policy, tables, reports: arithmetic on rankings, no model"),
    (frozenset({"retrieval"}), "the candidate generator, scored with evaluate's metrics"),
    (frozenset({"model"}), "the diffusion model and its attention masks"),
    (frozenset({"decode"}), "the one decoder, over model, under text's answer grammar"),
    (
        frozenset({"rank"}),
        "re-ranking by decoding, the operating point under evaluate's policy (its timer handed in)",
    ),
    (frozenset({"train"}), "the training stages, which decode and reward rankings"),
    (frozenset({"bench"}), "times decode and rank settings; the operating point's timer"),
    (frozenset({"runs"}), "MLflow runs: metrics, model folders, look-ups that name what is missing"),
    (frozenset({"serving"}), "the served re-ranker over rank's decoding, and its request log"),
    (frozenset({"registry"}), "versions and aliases, the gate, shadow replay and promotion of what serves"),
    (frozenset({"lineage"}), "what a run read and wrote, the walk back to raw files, a version's card"),
    (frozenset({"monitoring"}), "deliveries taken in, their drift, and whether a retrain has work to do"),
)
LAYER = {package: i for i, (packages, _) in enumerate(LAYERS) for package in packages}


def imported(source: str, module: str, is_package: bool = False) -> Iterator[tuple[int, str]]:
    """(line, absolute name) of every import in `source`, the source of `module`: module-level and
    inside functions, relative ones resolved; `from a import b` gives `a` and `a.b`."""
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            yield node.lineno, name
            yield from ((node.lineno, f"{name}.{alias.name}") for alias in node.names)


def package_of(name: str) -> str | None:
    """The core package (or base module: `io`, `env`) an absolute name lies in; None outside core."""
    parts = name.split(".")
    return parts[2] if parts[:2] == CORE.split(".") and len(parts) > 2 else None


def core_modules() -> dict[str, tuple[str, bool]]:
    """Every module of core: its name -> (its source, whether it is a package's `__init__`)."""
    modules = {}
    for path in sorted(CORE_DIR.rglob("*.py")):
        parts = list(path.relative_to(CORE_DIR.parent.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (
            path.read_text(encoding="utf-8"),
            is_package,
        )
    return modules


def upward(modules: Mapping[str, tuple[str, bool]]) -> list[str]:
    """Each import of a core package above the importer's layer, and each core package with no layer."""
    found = []
    for module, (source, is_package) in modules.items():
        mine = package_of(module)
        if mine is None:
            continue
        if mine not in LAYER:
            found.append(f"{module}: core package {mine!r} has no layer in LAYERS")
            continue
        for line, name in imported(source, module, is_package):
            theirs = package_of(name)
            if theirs is not None and theirs != mine and LAYER.get(theirs, len(LAYERS)) > LAYER[mine]:
                found.append(f"{module}:{line} imports core.{theirs}, above {mine}")
    return sorted(set(found))


def kedro(modules: Mapping[str, tuple[str, bool]]) -> list[str]:
    """Each import of Kedro in `modules`."""
    return sorted(
        {
            f"{module}:{line} imports kedro"
            for module, (source, is_package) in modules.items()
            for line, name in imported(source, module, is_package)
            if name == "kedro" or name.startswith("kedro.")
        }
    )


def test_core_never_imports_kedro() -> None:
    modules = core_modules()
    assert len(modules) > 50  # the walk found core
    assert not kedro(modules)


def test_each_core_package_imports_only_its_layer_and_below() -> None:
    modules = core_modules()
    on_disk = {package_of(m) for m in modules} - {None, "__init__"}
    assert on_disk == set(LAYER), "a core package is missing from LAYERS, or LAYERS names one that is gone"
    assert not upward(modules)


PLANTED = {  # a module of rank that reaches up, each way an import can be written
    "lazy": "def timer():\n    from diffusion_gr2.core.bench.benchmark import time_candidates\n",
    "relative": "from ..bench import benchmark\n",
    "from core": "from diffusion_gr2.core import monitoring\n",
    "plain": "import diffusion_gr2.core.train.loop\n",
}


@pytest.mark.parametrize("source", PLANTED.values(), ids=PLANTED.keys())
def test_the_check_catches_a_planted_upward_import(source: str) -> None:
    rank = {"diffusion_gr2.core.rank.planted": (source, False)}
    (found,) = upward(rank)
    assert found.startswith("diffusion_gr2.core.rank.planted:") and found.endswith(", above rank")
    # the same import from the top layer is allowed, and so is a downward one from rank
    assert not upward({"diffusion_gr2.core.monitoring.planted": (source, False)})
    assert not upward({"diffusion_gr2.core.rank.planted": ("from ..decode import decoder\n", False)})


def test_the_check_catches_a_planted_kedro_import_and_an_unlayered_package() -> None:
    source = "def load():\n    from kedro.io import AbstractDataset\n"
    assert kedro({"diffusion_gr2.core.base.planted": (source, False)}) == [
        "diffusion_gr2.core.base.planted:2 imports kedro"
    ]
    assert upward({"diffusion_gr2.core.newpkg.x": ("", False)}) == [
        "diffusion_gr2.core.newpkg.x: core package 'newpkg' has no layer in LAYERS"
    ]


UPWARD_IN_OPERATIONS = {  # the operations packages are ordered among themselves too
    "serving imports registry": ("serving", "from diffusion_gr2.core.registry.registry import resolve_uri\n"),
    "registry imports lineage": ("registry", "from diffusion_gr2.core.lineage import model_card\n"),
    "lineage imports monitoring": ("lineage", "from diffusion_gr2.core.monitoring.ingest import ingest\n"),
}


@pytest.mark.parametrize("package, source", UPWARD_IN_OPERATIONS.values(), ids=UPWARD_IN_OPERATIONS.keys())
def test_the_check_orders_the_operations_packages(package: str, source: str) -> None:
    (found,) = upward({f"diffusion_gr2.core.{package}.planted": (source, False)})
    assert found.endswith(f", above {package}")
