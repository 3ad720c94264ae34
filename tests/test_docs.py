"""The user-facing text describes the system as it is; its history lives in docs/experiments.md.

README.md, docs/*.md (but the record of experiments) and the comments of conf/ may not narrate when
what was done: no dates, no work sessions, no issue numbers, no "formerly" / "no longer" / "the
earlier run". A figure they need cites its evidence with a link to an experiments entry, and every
such link must name an entry that exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "docs" / "experiments.md"

# Each pattern with the narration it catches. Case-insensitive; chosen to leave ordinary present-tense
# text alone ("is used to", "no longer than", "earlier points", Kedro's `KedroSession`).
NARRATION = {
    "a date": r"\b20\d\d-\d\d-\d\d\b",
    "a work session": r"\bsession \d+|\bthis session\b",
    "an issue number": r"\bissues? #?\d+",
    "'formerly'": r"\bformerly\b",
    "'used to'": r"(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bbeing )\bused to\b",
    "'no longer'": r"\bno longer\b(?! than)",
    "'was/were changed'": r"\b(?:was|were) changed\b",
    "'the earlier run / machine / ...'": (
        r"\bearlier (?:runs?|machines?|rule|behaviou?r|figures?|defaults?|measurements?|sessions?)\b"
    ),
    "'the former default / ...'": r"\bformer (?:defaults?|rules?|values?|gates?|settings?|machines?)\b",
    "'before / until / since <a change>'": r"\b(?:before|until|since) (?:session|issue|commit)\b",
    "'written here before'": r"\bwritten here before\b",
    "'(before)'": r"\(before\)",
    "'the default then / now'": r"\b(?:default|rule|gate) (?:then|now)\b|\bthen in place\b|\bnow the default\b",
}
PATTERNS = [(what, re.compile(rx, re.IGNORECASE)) for what, rx in NARRATION.items()]


def _files() -> list[Path]:
    docs = [p for p in sorted((ROOT / "docs").glob("*.md")) if p != EXPERIMENTS]
    conf = sorted(
        p for ext in ("*.yml", "*.yaml") for p in (ROOT / "conf").rglob(ext) if "local" not in p.parts
    )
    return [ROOT / "README.md", *docs, *conf]


def _text(path: Path) -> list[tuple[int, str]]:
    """(line number, text) to check: every line of Markdown, the comments of a YAML file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix == ".md":
        return list(enumerate(lines, 1))
    return [(i, line[line.index("#") :]) for i, line in enumerate(lines, 1) if "#" in line]


def narration(path: Path) -> list[str]:
    """``path:line: <what> in '<text>'`` for every line that narrates history."""
    found = []
    for number, text in _text(path):
        for what, pattern in PATTERNS:
            if pattern.search(text):
                found.append(f"{path.relative_to(ROOT)}:{number}: {what} in {text.strip()!r}")
    return found


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_dated_narration(path: Path) -> None:
    found = narration(path)
    assert not found, "history belongs in docs/experiments.md:\n" + "\n".join(found)


def test_experiments_links_name_entries() -> None:
    headings = {
        _anchor(line.lstrip("#")) for line in EXPERIMENTS.read_text().splitlines() if line.startswith("#")
    }
    broken = []
    for path in [*_files(), EXPERIMENTS]:
        link = re.compile(r"\]\(#([\w\-]+)\)" if path == EXPERIMENTS else r"experiments\.md#([\w\-]+)")
        for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            broken += [
                f"{path.relative_to(ROOT)}:{number}: #{a}" for a in link.findall(text) if a not in headings
            ]
    assert not broken, "links to docs/experiments.md entries that do not exist:\n" + "\n".join(broken)


@pytest.mark.parametrize(
    "text",
    [
        "Session 11 (2026-12-02): the rule changed",
        "measured in this session",
        "the 1.6x written here before",
        "`recall@1_unforced` (formerly `recall@1_free`)",
        "the rule used to take one pass",
        "AR steps no longer rebuild it",
        "on the earlier machine",
        "the former default",
        "(issue 28's re-measurement)",
        "`test_points: 1`, no cap (before)",
    ],
)
def test_patterns_catch_narration(text: str) -> None:
    assert any(p.search(text) for _, p in PATTERNS)


@pytest.mark.parametrize(
    "text",
    [
        "Every process opens its own `KedroSession`",
        "the key is used to look the version up",
        "an id no longer than 64 characters",
        "those earlier points are shown as history but never trained on",
        "decoded before it is served",
        "the same decoder is then used",
    ],
)
def test_patterns_leave_present_tense_alone(text: str) -> None:
    assert not any(p.search(text) for _, p in PATTERNS)


# ---- documents outside the repository -------------------------------------------------------------

# What a reader of the repository cannot open: the workspace's design, style and reference notes and
# the documents the project was created from. Their names are built from parts, so that this file
# does not name them itself (a search of the repository for them comes back empty).
_design, _style, _reference = "DES" + "IGN", "STY" + "LE", "REFER" + "ENCE"
_OUTSIDE = "|".join(
    [
        r"\b" + _design + r"\s*§",
        r"\b" + _design + r"\.md\b",
        r"\b" + _style + r"\s+\d+",
        r"\b" + _style + r"\.md\b",
        r"\b" + _reference + r"\.md\b",
        r"(?<![\w.-])" + "seeds" + "/",
    ]
)
OUTSIDE_DOCUMENTS = re.compile(_OUTSIDE)
TEXT_SUFFIXES = {".py", ".md", ".yml", ".yaml", ".sh", ".toml", ".txt", ".j2", ".cfg", ".json"}


def _repository_texts() -> list[Path]:
    """Every text file of src, tests, benchmarks, conf (but a user's conf/local), docs, airflow_dags,
    and README.md, Makefile, dvc.yaml, pyproject.toml."""
    files = [ROOT / name for name in ("README.md", "Makefile", "dvc.yaml", "pyproject.toml")]
    for folder in ("src", "tests", "benchmarks", "conf", "docs", "airflow_dags"):
        files += sorted(
            p
            for p in (ROOT / folder).rglob("*")
            if p.is_file()
            and p.suffix in TEXT_SUFFIXES
            and "__pycache__" not in p.parts
            and p.relative_to(ROOT).parts[:2] != ("conf", "local")
        )
    return files


def outside_references(path: Path) -> list[str]:
    """``path:line: '<text>'`` for every line that points the reader at a document outside the repository."""
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if OUTSIDE_DOCUMENTS.search(line):
            found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()!r}")
    return found


def test_nothing_points_at_documents_outside_the_repository() -> None:
    found = [line for path in _repository_texts() for line in outside_references(path)]
    assert not found, (
        "these point at documents a user of the repository cannot read; point into docs/ instead "
        "(docs/architecture.md, evaluation.md, operations.md, distributed.md, defaults.md):\n"
        + "\n".join(found)
    )


@pytest.mark.parametrize(
    "text",
    [
        "(" + _design + " §4)",
        "see " + _design + "§10's keys",
        "the workspace's `shared/" + _design + ".md`",
        "(" + _style + " 3, " + _design + " §5)",
        "the house style (" + _style + ".md)",
        "numbers in " + _reference + ".md",
        "the documents in `" + "seeds" + "/`",
    ],
)
def test_outside_references_are_caught(text: str) -> None:
    assert OUTSIDE_DOCUMENTS.search(text)


@pytest.mark.parametrize(
    "text",
    ["CORE_KEYS = {", "the designs of both", "style: 3 lines", "three seeds (0, 1, 2)", "a seeded shuffle"],
)
def test_ordinary_words_are_not_outside_references(text: str) -> None:
    assert not OUTSIDE_DOCUMENTS.search(text)


# ---- the module map names every module ------------------------------------------------------------

ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "src" / "diffusion_gr2"


def module_map() -> dict[str, str]:
    """The `## Module map` section of docs/architecture.md as bullet head -> bullet text: a bullet starts
    with `* ` (nested ones indented) and its head is its first backticked folder, `core/train/`."""
    text = ARCHITECTURE.read_text(encoding="utf-8").split("\n## Module map\n", 1)[1].split("\n## ", 1)[0]
    bullets: dict[str, str] = {}
    head = None
    for line in text.splitlines():
        start = re.match(r"\s*\* `([\w/]+/)`", line)
        if start:
            head = start.group(1)
            bullets[head] = bullets.get(head, "") + line
        elif head is not None and line.startswith(" "):
            bullets[head] += " " + line.strip()
        else:
            head = None
    return bullets


def unmapped(modules: list[str], bullets: dict[str, str]) -> list[str]:
    """The modules (`core/train/trajectory.py`, relative to the package) that no bullet of their folder
    names (`` `trajectory.py` ``), nor the map by their path."""
    everything = " ".join(bullets.values())
    missing = []
    for module in modules:
        folder, name = module.rsplit("/", 1)
        named = f"`{name}`" in bullets.get(folder + "/", "") or module in everything
        if not named:
            missing.append(module)
    return missing


def _modules() -> list[str]:
    return sorted(
        str(p.relative_to(PACKAGE))
        for folder in ("core", "pipelines")
        for p in (PACKAGE / folder).rglob("*.py")
        if p.name != "__init__.py"
    )


def test_the_module_map_names_every_module() -> None:
    missing = unmapped(_modules(), module_map())
    assert not missing, (
        "docs/architecture.md#module-map has no line for: " + ", ".join(missing) + " (add the module to "
        "its folder's bullet, or a bullet for a new folder)"
    )


def test_a_module_without_a_line_is_caught() -> None:
    bullets = module_map()
    assert unmapped(["core/train/loop.py", "core/train/not_a_module.py", "core/nowhere/x.py"], bullets) == [
        "core/train/not_a_module.py",
        "core/nowhere/x.py",
    ]
