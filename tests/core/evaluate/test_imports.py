"""Metrics stay on their side: core/evaluate computes figures from rankings frames and imports
nothing from core/rank, which re-ranks (and reads the metrics)."""

from __future__ import annotations

import ast
from pathlib import Path

EVALUATE = Path(__file__).resolve().parents[3] / "src/diffusion_gr2/core/evaluate"


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):  # function-level imports included
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return names


def test_core_evaluate_imports_nothing_from_core_rank() -> None:
    modules = sorted(EVALUATE.glob("*.py"))
    assert modules
    reaching = {
        p.name: sorted(m for m in _imported(p) if m.startswith("diffusion_gr2.core.rank")) for p in modules
    }
    assert not {name: found for name, found in reaching.items() if found}
