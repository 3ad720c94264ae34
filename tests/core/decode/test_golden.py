"""The decoder against its golden dump: every configuration the pipelines, operating points and
benchmarks use, token for token as the decoder wrote it before its split into strategies (`golden.py`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.core.decode import golden
from tests.core.model.tiny import DEVICE

GOLDEN = Path(__file__).with_name("golden_decode.json")
pytestmark = pytest.mark.skipif(
    DEVICE.type != "cpu", reason="recorded on the CPU: GPU kernels sum in another order"
)


@pytest.fixture(scope="module")
def want() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def world() -> Iterator[golden.World]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as recorded: the same sums, so the same ties
    yield golden.world()
    torch.set_num_threads(threads)


def test_every_case_is_recorded(want: dict[str, Any]) -> None:
    assert sorted(want) == sorted(golden.cases())


def test_the_cases_exercise_what_they_name(want: dict[str, Any]) -> None:
    """The dump can catch a change in each feature: each one changes the record of its case."""

    def tokens(name: str) -> list[list[int]]:
        return [row["tokens"] for row in want[name]]

    def nfe(name: str) -> int:
        return sum(row["nfe"] for row in want[name])

    for g in ("free", "plain"):
        assert nfe(f"dm0.4/{g}") < nfe(f"dm0.75/{g}") < sum(len(t) for t in tokens(f"dm0.75/{g}"))
        assert tokens(f"dm0.75/sid-standin/{g}") != tokens(f"dm0.75/{g}")  # the SID gate
        assert tokens(f"dm0.75/sid/copy/{g}") != tokens(f"dm0.75/sid/{g}")  # lossy copy drafts
        assert nfe(f"dm0.75/sid/separate/{g}") != nfe(f"dm0.75/sid/{g}")  # fused
    assert tokens("dm0.75/sid-standin-list/plain") != tokens("dm0.75/sid-standin/plain")  # its scope
    assert tokens("dm0.75/sid/window4/plain") != tokens("dm0.75/sid/plain") or nfe(
        "dm0.75/sid/window4/plain"
    ) != nfe("dm0.75/sid/plain")
    for who in ("ar+pld3", "ar+dm-draft", "ar+twin-draft"):  # lossless: plain AR's tokens, fewer forwards
        assert tokens(f"{who}/plain/b6") == tokens("ar/plain/b6")
        assert nfe(f"{who}/free/b6") < nfe("ar/free/b6")
    assert nfe("ar/plain/b1") < nfe("ar/plain/nojump/b1")  # AR jump-forward
    assert sum(row["forced"] for row in want["ar/plain/b6"]) > 0  # the grammar corrects the model


@pytest.mark.parametrize("name", sorted(golden.cases()))
def test_decodes_as_recorded(world: golden.World, want: dict[str, Any], name: str) -> None:
    got = golden.record(golden.run(world, golden.cases()[name]))
    assert list(golden.differences({name: got}, {name: want[name]})) == []
