"""No function or method in src is longer than 60 lines (issue 58): a long one is split into named
helpers. Length is `end_lineno - lineno + 1` of the `def`, docstring included, decorators excluded."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "diffusion_gr2"
MAX_LINES = 60


def long_functions(root: Path, limit: int = MAX_LINES) -> list[tuple[str, str, int]]:
    """(file:line, name, length) of every function or method under `root` longer than `limit` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append((f"{path.relative_to(root.parents[1])}:{node.lineno}", node.name, length))
    return found


def test_no_function_longer_than_60_lines() -> None:
    offenders = long_functions(SRC)
    assert not offenders, f"functions over {MAX_LINES} lines (split them into named helpers): " + "; ".join(
        f"{where} {name} ({length} lines)" for where, name, length in offenders
    )


def test_the_check_sees_a_long_function(tmp_path: Path) -> None:
    """The counter itself: a decorated 61-line function is caught, decorators not counted."""
    package = tmp_path / "src" / "pkg"
    package.mkdir(parents=True)
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    (package / "m.py").write_text(
        f"@staticmethod\ndef long():\n{body}\n    return 0\n\n\ndef short():\n    pass\n"
    )
    assert long_functions(package) == [("src/pkg/m.py:2", "long", 61)]
    assert long_functions(package, limit=61) == []
